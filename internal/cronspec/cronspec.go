// Package cronspec reads cron specs and checks cron entries, for the
// scheduler that runs them and the operator API that changes them at run time.
package cronspec

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/robfig/cron/v3"
)

// Schedule is when an entry ticks: Next returns the first tick after t (the
// zero time if there is none). Next must depend on t alone, so that every
// instance computes the same ticks.
type Schedule interface {
	Next(t time.Time) time.Time
}

// parser reads 5-field specs, 6-field specs with seconds first, and
// descriptors.
var parser = cron.NewParser(cron.SecondOptional | cron.Minute | cron.Hour | cron.Dom | cron.Month | cron.Dow | cron.Descriptor)

func Parse(spec string, loc *time.Location, zoneGiven bool) (sched Schedule, err error) {
	s := strings.TrimSpace(spec)
	if s == "" {
		return nil, errors.New("empty")
	}
	if strings.HasPrefix(s, "TZ=") || strings.HasPrefix(s, "CRON_TZ=") {
		if zoneGiven {
			return nil, errors.New("time zone given twice, in the spec and in timezone")
		}
		// Parsed here: robfig/cron panics on a zone prefix with nothing after it.
		i := strings.IndexAny(s, " \t")
		if i < 0 {
			return nil, errors.New("nothing after the time zone")
		}
		name := s[strings.IndexByte(s, '=')+1 : i]
		if loc, err = time.LoadLocation(name); err != nil {
			return nil, err
		}
		s = strings.TrimSpace(s[i:])
	}
	if rest, ok := strings.CutPrefix(s, "@every"); ok {
		d, err := time.ParseDuration(strings.TrimSpace(rest))
		if err != nil {
			return nil, err
		}
		if d < time.Second || d%time.Second != 0 {
			return nil, errors.New("@every needs a whole number of seconds, at least 1s")
		}
		return Every(d), nil
	}
	defer func() {
		if r := recover(); r != nil {
			sched, err = nil, fmt.Errorf("unparsable: %v", r)
		}
	}()
	if err := checkSteps(s); err != nil {
		return nil, err
	}
	cs, err := parser.Parse(s)
	if err != nil {
		return nil, err
	}
	ss, ok := cs.(*cron.SpecSchedule)
	if !ok {
		return nil, fmt.Errorf("unsupported schedule %T", cs)
	}
	// Matched against local times written as UTC (see wallClock); the parser's
	// default, the host's zone, must never leak in.
	ss.Location = time.UTC
	if loc == time.UTC {
		return ss, nil
	}
	return wallClock{spec: ss, loc: loc}, nil
}

// fieldSpans name a spec's fields and count their values, seconds first
// (a 5-field spec starts at the minutes).
var fieldSpans = []struct {
	name string
	n    int
	per  string // what the field cycles within
}{{"second", 60, "minute"}, {"minute", 60, "hour"}, {"hour", 24, "day"}, {"day of month", 31, "month"},
	{"month", 12, "year"}, {"day of week", 7, "week"}}

// checkSteps refuses a step longer than its field, which the parser takes:
// */90 in the minutes reads as "every 90 minutes" and fires hourly, at :00.
func checkSteps(s string) error {
	fields := strings.Fields(s)
	if len(fields) == 0 || strings.HasPrefix(fields[0], "@") || len(fields) > 6 {
		return nil // a descriptor, or the parser's error to give
	}
	spans := fieldSpans[6-len(fields):]
	for i, f := range fields {
		if i >= len(spans) {
			break
		}
		for _, part := range strings.Split(f, ",") {
			_, step, ok := strings.Cut(part, "/")
			if !ok {
				continue
			}
			if n, err := strconv.Atoi(step); err == nil && n > spans[i].n {
				return fmt.Errorf("%s field %q: a step of %d is longer than the field's %d values, so it fires once per %s, not every %d; for a fixed interval use @every (e.g. @every 90m)",
					spans[i].name, f, n, spans[i].n, spans[i].per, n)
			}
		}
	}
	return nil
}

// Every ticks at whole multiples of a duration since the Unix epoch.
type Every time.Duration

func (d Every) Next(t time.Time) time.Time {
	step := int64(d)
	n := t.UnixNano()
	q := n / step
	if n < 0 && n%step != 0 {
		q--
	}
	return time.Unix(0, (q+1)*step).UTC()
}

// maxShift bounds a daylight-saving change (real ones are 30 min to 2 h).
const maxShift = 3 * time.Hour

// wallClock reads a cron spec on the wall clock of loc: every local time that
// matches ticks once, at its first occurrence; a local time that a DST change
// skips ticks at the instant it names on the clock before the change (02:30
// CET is 03:30 CEST). robfig/cron instead steps through instants, so a
// nightly 02:30 job would not run on the night clocks go forward and would
// run twice on the night they go back.
type wallClock struct {
	spec *cron.SpecSchedule // Location UTC: matches local times written as UTC
	loc  *time.Location
}

func (c wallClock) Next(t time.Time) time.Time {
	// Start from t's local time on the smaller of the offsets around it: a
	// skipped local time is read on the earlier offset, and starting low
	// only costs local times whose instant is not after t.
	_, now := t.In(c.loc).Zone()
	_, before := t.Add(-maxShift).In(c.loc).Zone()
	w := t.UTC().Add(time.Duration(min(now, before)) * time.Second)
	for {
		if w = c.spec.Next(w); w.IsZero() {
			return w
		}
		if at := c.instant(w); at.After(t) {
			return at
		}
	}
}

// instant is when local time w (written as UTC) first happens in loc; for a
// local time a DST change skips, the instant w names on the earlier offset.
func (c wallClock) instant(w time.Time) time.Time {
	_, off := w.In(c.loc).Zone()
	near := w.Add(-time.Duration(off) * time.Second) // within a shift of the answer
	_, early := near.Add(-maxShift).In(c.loc).Zone()
	_, late := near.Add(maxShift).In(c.loc).Zone()
	var first time.Time
	for _, o := range []int{early, late} {
		at := w.Add(-time.Duration(o) * time.Second)
		if reads(at.In(c.loc), w) && (first.IsZero() || at.Before(first)) {
			first = at
		}
	}
	if first.IsZero() {
		first = w.Add(-time.Duration(early) * time.Second)
	}
	return first
}

// reads reports whether local time l shows w's wall clock.
func reads(l, w time.Time) bool {
	ly, lm, ld := l.Date()
	wy, wm, wd := w.Date()
	return ly == wy && lm == wm && ld == wd && l.Hour() == w.Hour() && l.Minute() == w.Minute() && l.Second() == w.Second()
}

// RecentTicks returns up to n of sch's latest ticks in (after, now], oldest
// first, and whether older ticks in that range were left out. It looks back
// from now in a doubling window rather than stepping forward from after, so a
// cursor left far behind (a dense entry off for a week) costs little.
func RecentTicks(sch Schedule, after, now time.Time, n int) (ticks []time.Time, more bool) {
	if n < 1 || !now.After(after) {
		return nil, false
	}
	const maxWindow = 100 * 365 * 24 * time.Hour
	for w := time.Second; ; w *= 2 {
		start := now.Add(-w)
		whole := w >= maxWindow || !start.After(after)
		if whole {
			start = after
		}
		ticks = ticksIn(sch, start, now, n)
		if len(ticks) == n || whole {
			break
		}
	}
	if len(ticks) == 0 {
		return nil, false
	}
	return ticks, sch.Next(after).Before(ticks[0])
}

// ticksIn returns the last n ticks in (start, end], oldest first.
func ticksIn(sch Schedule, start, end time.Time, n int) []time.Time {
	ring := make([]time.Time, 0, n)
	next := 0
	for t := sch.Next(start); !t.IsZero() && !t.After(end); t = sch.Next(t) {
		if len(ring) < n {
			ring = append(ring, t)
			continue
		}
		ring[next] = t
		next = (next + 1) % n
	}
	out := make([]time.Time, 0, len(ring))
	return append(append(out, ring[next:]...), ring[:next]...)
}
