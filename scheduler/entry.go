package scheduler

import (
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/keeljobs/keel/internal/cronspec"
	"github.com/keeljobs/keel/tasks"
)

// Entry is one cron job: enqueue a task of Kind with Payload at every tick
// of Spec.
type Entry struct {
	// Name identifies the entry. It is unique within a schedule and part of
	// every tick's business key (see TickKey), so renaming an entry starts it
	// afresh. 1 to MaxNameBytes letters, digits and - _ . : /.
	Name string
	// Spec says when the entry ticks: a cron spec of 5 fields (minute hour
	// day-of-month month day-of-week) or 6 with seconds first, or a
	// descriptor: @yearly, @monthly, @weekly, @daily (@midnight), @hourly, or
	// @every <duration>. "@every D" ticks at whole multiples of D since the
	// Unix epoch, not D after the scheduler started, so that every instance
	// computes the same ticks; D is a whole number of seconds, at least 1s.
	Spec string
	// TimeZone is the IANA zone (Europe/Berlin) a cron spec is read in.
	// Default UTC. A CRON_TZ= prefix in Spec does the same; give one or the
	// other. @every ignores zones. Each matching local time ticks once: on
	// the night clocks go back, at its first occurrence; on the night they go
	// forward, a local time that does not exist ticks an hour later by the
	// new clock (02:30 becomes 03:30), so a nightly job never skips a night.
	TimeZone string
	// Kind is the task kind to enqueue (one of Config.Kinds, unless
	// Config.KnownKind says otherwise).
	Kind string
	// Payload is the task's JSON payload. Default {}.
	Payload json.RawMessage
	// Queue overrides the kind's queue.
	Queue string
	// MaxRetry overrides the task's retry budget; nil keeps the kind's
	// (Config.Kinds).
	MaxRetry *int
	// Timeout bounds one attempt; 0 keeps the kind's (Config.Kinds).
	Timeout time.Duration
}

// MaxNameBytes bounds an entry's name, keeping its business keys short.
const MaxNameBytes = cronspec.MaxNameBytes

// TickKey is the business key of entry name's job for the tick at tick:
// cron:<name>:<tick in UTC, RFC 3339>. Every scheduler instance derives the
// same key for the same tick, so the ledger keeps one job per tick however
// many instances enqueue it. Use it to look a tick's job up.
func TickKey(name string, tick time.Time) string {
	return cronspec.TickKey(name, tick)
}

// Next returns the entry's first tick after t, or an error when the entry is
// invalid (its kind is not checked).
func (e Entry) Next(t time.Time) (time.Time, error) {
	c, err := compile(e, nil)
	if err != nil {
		return time.Time{}, err
	}
	return c.sched.Next(t), nil
}

// ErrInvalidEntry is wrapped by every EntryError.
var ErrInvalidEntry = errors.New("invalid schedule entry")

// EntryError says what is wrong with one entry of a schedule.
type EntryError struct {
	// Name is the entry's name; Index its position (from 1), used when the
	// name is missing.
	Name  string
	Index int
	// Field is the entry field at fault: name, spec, timezone, kind, payload,
	// queue, max_retry or timeout.
	Field string
	Err   error
}

func (e *EntryError) Error() string {
	if e.Name == "" {
		return fmt.Sprintf("schedule entry #%d: %v", e.Index, e.Err)
	}
	return fmt.Sprintf("schedule entry %q: %v", e.Name, e.Err)
}

func (e *EntryError) Unwrap() []error { return []error{ErrInvalidEntry, e.Err} }

// AnyKind accepts every kind: set Config.KnownKind to it when the kinds are
// declared in another program (the workers) and not in the scheduler's.
func AnyKind(string) bool { return true }

// ValidateEntries checks entries as a scheduler does at start: names unique
// and well formed, specs, time zones and payloads valid, and every kind known
// to knownKind (nil skips that check). The first problem is returned as an
// *EntryError.
func ValidateEntries(entries []Entry, knownKind func(string) bool) error {
	_, err := compileAll(entries, knownKind)
	return err
}

// compiled is a validated entry with its parsed schedule.
type compiled struct {
	Entry
	sched cronspec.Schedule
}

// sameSchedule reports whether two versions of an entry tick at the same
// times, so a reload that changes only the task keeps the entry's place.
func (c compiled) sameSchedule(o compiled) bool {
	return c.Spec == o.Spec && c.TimeZone == o.TimeZone
}

func compileAll(entries []Entry, knownKind func(string) bool) ([]compiled, error) {
	out := make([]compiled, 0, len(entries))
	seen := map[string]int{}
	for i, e := range entries {
		c, err := compile(e, knownKind)
		if err != nil {
			var ee *EntryError
			if errors.As(err, &ee) {
				ee.Index = i + 1
			}
			return nil, err
		}
		if j, dup := seen[e.Name]; dup {
			return nil, &EntryError{Name: e.Name, Index: i + 1, Field: "name",
				Err: fmt.Errorf("duplicate name: entries #%d and #%d", j, i+1)}
		}
		seen[e.Name] = i + 1
		out = append(out, c)
	}
	return out, nil
}

func compile(e Entry, knownKind func(string) bool) (compiled, error) {
	ce, sched, field, err := cronspec.Check(cronspec.Entry(e), knownKind, tasks.MaxPayloadBytes)
	if err != nil {
		return compiled{}, &EntryError{Name: e.Name, Field: field, Err: err}
	}
	return compiled{Entry: Entry(ce), sched: sched}, nil
}
