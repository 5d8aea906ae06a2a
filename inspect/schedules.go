package inspect

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/cronspec"
	"github.com/keeljobs/keel/internal/ledger"
)

// ScheduleEntry is a cron entry added at run time: its fields mean what
// scheduler.Entry's do (scheduler.Entry(e) converts it).
type ScheduleEntry = cronspec.Entry

// ScheduleSource says where an entry is defined.
type ScheduleSource string

const (
	// SourceLedger: added at run time (AddSchedule), changed with
	// SetSchedule and RemoveSchedule.
	SourceLedger ScheduleSource = "ledger"
	// SourceConfig: a scheduler's file or code; changed there. What the
	// entry is comes from the schedulers running it (SeenAt).
	SourceConfig ScheduleSource = "config"
)

var (
	// ErrScheduleExists means AddSchedule named an entry that exists: in
	// the ledger, or in a scheduler's file or code.
	ErrScheduleExists = errors.New("keel: a schedule entry of that name exists")
	// ErrScheduleConfigured means a change was asked of an entry a
	// scheduler's file or code defines: change it there.
	ErrScheduleConfigured = errors.New("keel: the schedule entry is defined in a scheduler's file or code; change it there")
)

// Schedule is a cron entry as the operator sees it.
type Schedule struct {
	ScheduleEntry
	Source ScheduleSource
	// CreatedBy, CreatedAt, UpdatedBy, UpdatedAt: a run-time entry's
	// history (the audit log has every change).
	CreatedBy, UpdatedBy string
	CreatedAt, UpdatedAt time.Time
	// SeenAt is when a scheduler last said it runs the entry (within a
	// minute or two while one does); nil if none has.
	SeenAt *time.Time
	// Paused is who paused the entry, when and why; nil if it runs.
	Paused *SchedulePause
	// LastTick is the newest tick handled (a job made, or skipped while
	// paused or missed), or, after its spec or time zone changed, the time
	// of the change (the new schedule's ticks start after it); nil before
	// the first.
	LastTick *time.Time
	// NextTick is the next tick that makes a job; nil while paused, or when
	// the spec is not known (a scheduler older than this keel runs it).
	NextTick *time.Time
	// Ticks are the newest ticks up to LastTick, newest first, with the
	// job each made.
	Ticks []Tick
}

// RunTimeout is how long after a scheduler last said it runs an entry
// (SeenAt) Running turns false; schedulers say so every minute.
const RunTimeout = 5 * time.Minute

// Running reports whether a scheduler has said lately (RunTimeout) that it
// runs the entry: false for an entry no scheduler runs (none is up, or the
// entry left their files), which makes no job whatever it says.
func (s Schedule) Running(now time.Time) bool {
	return s.SeenAt != nil && now.Sub(*s.SeenAt) < RunTimeout
}

// SchedulePause is who paused an entry, when and why.
type SchedulePause = ledger.SchedulePause

// Tick is one tick of an entry and the job it made: JobID empty when it
// made none (paused, missed, or the spec changed since).
type Tick struct {
	At     time.Time
	JobID  string
	Status idempotency.Status
}

// ticksShown is how many recent ticks Schedules looks up per entry.
const ticksShown = 5

// Schedules returns every cron entry the ledger knows, by name: those
// added at run time, and those schedulers run from their file or code
// (known once a scheduler has run them).
func (in *Inspector) Schedules(ctx context.Context) ([]Schedule, error) {
	entries, err := ledger.ScheduleEntries(ctx, in.pool)
	if err != nil {
		return nil, interpret(err)
	}
	pauses, err := ledger.SchedulePauses(ctx, in.pool)
	if err != nil {
		return nil, interpret(err)
	}
	states, err := ledger.ScheduleStates(ctx, in.pool)
	if err != nil {
		return nil, interpret(err)
	}
	byName := map[string]*Schedule{}
	get := func(name string) *Schedule {
		s, ok := byName[name]
		if !ok {
			s = &Schedule{ScheduleEntry: ScheduleEntry{Name: name}, Source: SourceConfig}
			byName[name] = s
		}
		return s
	}
	for _, e := range entries {
		s := get(e.Name)
		s.ScheduleEntry, s.Source = fromLedger(e), SourceLedger
		s.CreatedBy, s.UpdatedBy, s.CreatedAt, s.UpdatedAt = e.CreatedBy, e.UpdatedBy, e.CreatedAt, e.UpdatedAt
	}
	for _, st := range states {
		s := get(st.Entry)
		tick := st.LastTick
		s.LastTick, s.SeenAt = &tick, st.SeenAt
		if s.Source == SourceConfig && st.Spec != nil {
			s.Spec, s.TimeZone = *st.Spec, st.TimeZone
			if st.Kind != nil {
				s.Kind = *st.Kind
			}
		}
	}
	for _, p := range pauses {
		get(p.Entry).Paused = &p
	}
	now := time.Now()
	var kinds, keys []string
	for _, s := range byName {
		_, sched, _, err := cronspec.Check(s.ScheduleEntry, nil, maxSchedulePayload)
		if err != nil {
			continue // a spec not known, or written by another version
		}
		if s.Paused == nil {
			next := sched.Next(now)
			s.NextTick = &next
		}
		if s.LastTick != nil {
			ticks, _ := cronspec.RecentTicks(sched, s.LastTick.Add(-366*24*time.Hour), *s.LastTick, ticksShown)
			for _, t := range slices.Backward(ticks) {
				if t.Before(s.CreatedAt) {
					break // before a run-time entry existed
				}
				s.Ticks = append(s.Ticks, Tick{At: t})
				kinds, keys = append(kinds, s.Kind), append(keys, cronspec.TickKey(s.Name, t))
			}
		}
	}
	jobs, err := ledger.TickJobs(ctx, in.pool, kinds, keys)
	if err != nil {
		return nil, interpret(err)
	}
	made := map[[2]string]ledger.TickJob{}
	for _, j := range jobs {
		made[[2]string{j.Kind, j.BusinessKey}] = j
	}
	out := make([]Schedule, 0, len(byName))
	for _, s := range byName {
		for i, t := range s.Ticks {
			if j, ok := made[[2]string{s.Kind, cronspec.TickKey(s.Name, t.At)}]; ok {
				s.Ticks[i].JobID, s.Ticks[i].Status = j.ID, j.Status
			}
		}
		out = append(out, *s)
	}
	slices.SortFunc(out, func(a, b Schedule) int {
		switch {
		case a.Name < b.Name:
			return -1
		case a.Name > b.Name:
			return 1
		}
		return 0
	})
	return out, nil
}

// Schedule returns the entry name, as Schedules does; ErrNotFound when
// the ledger does not know it.
func (in *Inspector) Schedule(ctx context.Context, name string) (Schedule, error) {
	all, err := in.Schedules(ctx)
	if err != nil {
		return Schedule{}, err
	}
	i := slices.IndexFunc(all, func(s Schedule) bool { return s.Name == name })
	if i < 0 {
		return Schedule{}, fmt.Errorf("%w: no schedule entry %q", ErrNotFound, name)
	}
	return all[i], nil
}

// maxSchedulePayload is tasks.MaxPayloadBytes (tasks uses this package).
const maxSchedulePayload = 256 << 10

func fromLedger(e ledger.ScheduleEntry) ScheduleEntry {
	return ScheduleEntry{Name: e.Name, Spec: e.Spec, TimeZone: e.TimeZone, Kind: e.Kind, Payload: e.Payload,
		Queue: e.Queue, MaxRetry: e.MaxRetry, Timeout: time.Duration(e.TimeoutMS) * time.Millisecond}
}

func toLedger(e ScheduleEntry) ledger.ScheduleEntry {
	return ledger.ScheduleEntry{Name: e.Name, Spec: e.Spec, TimeZone: e.TimeZone, Kind: e.Kind, Payload: e.Payload,
		Queue: e.Queue, MaxRetry: e.MaxRetry, TimeoutMS: e.Timeout.Milliseconds()}
}

// checkSchedule validates e as a scheduler does (its spec read by the
// same parser), its kind against Config.KnownKind.
func (in *Inspector) checkSchedule(e ScheduleEntry, actor string) (ScheduleEntry, error) {
	if err := needActor(actor); err != nil {
		return e, err
	}
	if e.Timeout%time.Millisecond != 0 {
		return e, fmt.Errorf("keel: schedule entry %q: timeout %s: whole milliseconds", e.Name, e.Timeout)
	}
	e, _, _, err := cronspec.Check(e, in.knownKind, maxSchedulePayload)
	if err != nil {
		return e, fmt.Errorf("keel: schedule entry %q: %w", e.Name, err)
	}
	return e, nil
}

// AddSchedule adds a cron entry at run time, audited: every running
// scheduler runs it within its Config.Poll (2 s), one job per tick however
// many run. It starts afresh, with no ticks before it to catch up. A name
// that exists (in the ledger, or in the file or code of a scheduler that
// ran in the last few minutes) is refused with ErrScheduleExists.
func (in *Inspector) AddSchedule(ctx context.Context, e ScheduleEntry, actor, note string) error {
	e, err := in.checkSchedule(e, actor)
	if err != nil {
		return err
	}
	states, err := ledger.ScheduleStates(ctx, in.pool)
	if err != nil {
		return interpret(err)
	}
	for _, st := range states {
		if st.Entry == e.Name && st.Spec != nil && st.SeenAt != nil && time.Since(*st.SeenAt) < RunTimeout {
			return fmt.Errorf("%w: %q, run by a scheduler", ErrScheduleExists, e.Name)
		}
	}
	added, err := ledger.AddScheduleEntry(ctx, in.pool, toLedger(e), actor, note)
	if err != nil {
		return interpret(err)
	}
	if !added {
		return fmt.Errorf("%w: %q", ErrScheduleExists, e.Name)
	}
	return nil
}

// SetSchedule replaces the run-time entry e.Name with e, audited. A new
// spec or time zone starts the entry afresh on every scheduler, with no
// missed ticks; a changed task (kind, payload, queue...) applies from the
// next tick. ErrNotFound if there is no such run-time entry.
func (in *Inspector) SetSchedule(ctx context.Context, e ScheduleEntry, actor, note string) error {
	e, err := in.checkSchedule(e, actor)
	if err != nil {
		return err
	}
	done, err := ledger.UpdateScheduleEntry(ctx, in.pool, toLedger(e), actor, note)
	if err != nil {
		return interpret(err)
	}
	if !done {
		return in.notRuntime(ctx, e.Name)
	}
	return nil
}

// RemoveSchedule deletes the run-time entry name, audited: schedulers stop
// its ticks within their Config.Poll. Jobs its ticks made are left alone.
func (in *Inspector) RemoveSchedule(ctx context.Context, name, actor, note string) error {
	if err := needActor(actor); err != nil {
		return err
	}
	done, err := ledger.RemoveScheduleEntry(ctx, in.pool, name, actor, note)
	if err != nil {
		return interpret(err)
	}
	if !done {
		return in.notRuntime(ctx, name)
	}
	return nil
}

// notRuntime says why name is not a run-time entry.
func (in *Inspector) notRuntime(ctx context.Context, name string) error {
	s, err := in.Schedule(ctx, name)
	if err != nil {
		return err
	}
	if s.Source == SourceConfig {
		return fmt.Errorf("%w: %q", ErrScheduleConfigured, name)
	}
	return fmt.Errorf("%w: no schedule entry %q", ErrNotFound, name) // removed meanwhile
}

// PauseSchedule stops every scheduler from enqueueing entry name's ticks,
// whatever defines it, until ResumeSchedule; audited, kept in the ledger
// (a restarted scheduler finds it). The ticks that come due meanwhile make
// no job and are not caught up. It reports false when the entry was
// paused already; ErrNotFound when the ledger does not know the entry.
func (in *Inspector) PauseSchedule(ctx context.Context, name, actor, note string) (bool, error) {
	if err := needActor(actor); err != nil {
		return false, err
	}
	if _, err := in.Schedule(ctx, name); err != nil {
		return false, err
	}
	done, err := ledger.PauseSchedule(ctx, in.pool, name, actor, note)
	return done, interpret(err)
}

// ResumeSchedule lets schedulers enqueue entry name's ticks again, from
// the next one; audited. It reports false when the entry was not paused.
func (in *Inspector) ResumeSchedule(ctx context.Context, name, actor, note string) (bool, error) {
	if err := needActor(actor); err != nil {
		return false, err
	}
	done, err := ledger.ResumeSchedule(ctx, in.pool, name, actor, note)
	return done, interpret(err)
}
