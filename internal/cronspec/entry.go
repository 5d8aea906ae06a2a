package cronspec

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"
)

// Entry is a cron entry's fields (scheduler.Entry documents them).
type Entry struct {
	Name     string
	Spec     string
	TimeZone string
	Kind     string
	Payload  json.RawMessage
	Queue    string
	MaxRetry *int
	Timeout  time.Duration
}

// MaxNameBytes bounds an entry's name, keeping its business keys short.
const MaxNameBytes = 200

// Check validates e and returns it with its defaults (payload {}) and its
// schedule; on failure, the field at fault (name, spec, timezone, kind,
// payload, queue, max_retry or timeout) and why. A kind knownKind refuses
// is an error (nil accepts every kind); maxPayload bounds the payload.
func Check(e Entry, knownKind func(string) bool, maxPayload int) (Entry, Schedule, string, error) {
	bad := func(field string, format string, args ...any) (Entry, Schedule, string, error) {
		return Entry{}, nil, field, fmt.Errorf(format, args...)
	}
	if err := validName(e.Name); err != nil {
		return bad("name", "bad name %q: %v", e.Name, err)
	}
	if e.TimeZone != "" {
		if _, err := time.LoadLocation(e.TimeZone); err != nil {
			return bad("timezone", "bad timezone %q: %v", e.TimeZone, err)
		}
	}
	sched, err := ParseIn(e.Spec, e.TimeZone)
	if err != nil {
		return bad("spec", "bad spec %q: %v", e.Spec, err)
	}
	if sched.Next(time.Now()).IsZero() {
		return bad("spec", "bad spec %q: it never ticks", e.Spec)
	}
	if e.Kind == "" {
		return bad("kind", "no kind given")
	}
	if knownKind != nil && !knownKind(e.Kind) {
		return bad("kind", "unknown kind %q: not one of this program's kinds", e.Kind)
	}
	if len(e.Payload) == 0 {
		e.Payload = json.RawMessage(`{}`)
	}
	if !json.Valid(e.Payload) {
		return bad("payload", "bad payload: not valid JSON")
	}
	if n := len(e.Payload); n > maxPayload {
		return bad("payload", "bad payload: %d bytes, limit %d", n, maxPayload)
	}
	if e.Queue != strings.TrimSpace(e.Queue) {
		return bad("queue", "bad queue %q: surrounding spaces", e.Queue)
	}
	if e.MaxRetry != nil && *e.MaxRetry < 0 {
		return bad("max_retry", "bad max_retry %d: negative", *e.MaxRetry)
	}
	if e.Timeout < 0 {
		return bad("timeout", "bad timeout %s: negative", e.Timeout)
	}
	return e, sched, "", nil
}

// ParseIn parses spec read in the IANA zone timezone (UTC when empty), as
// an entry's are.
func ParseIn(spec, timezone string) (Schedule, error) {
	loc := time.UTC
	if timezone != "" {
		l, err := time.LoadLocation(timezone)
		if err != nil {
			return nil, err
		}
		loc = l
	}
	return Parse(spec, loc, timezone != "")
}

func validName(name string) error {
	switch {
	case name == "":
		return errors.New("empty")
	case len(name) > MaxNameBytes:
		return fmt.Errorf("%d bytes, limit %d", len(name), MaxNameBytes)
	}
	for _, r := range name {
		ok := r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || strings.ContainsRune("-_.:/", r)
		if !ok {
			return fmt.Errorf("%q is not allowed (letters, digits and - _ . : /)", r)
		}
	}
	return nil
}

// TickKey is scheduler.TickKey: the business key of entry name's job for
// its tick at tick.
func TickKey(name string, tick time.Time) string {
	return "cron:" + name + ":" + tick.UTC().Format(time.RFC3339)
}
