package scheduler_test

import (
	"context"
	"errors"
	"math"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/scheduler"
	"github.com/keeljobs/keel/tasks"
)

func everySecond(name string) scheduler.Entry {
	return scheduler.Entry{Name: name, Spec: "* * * * * *", Kind: tickKind.Name(), Payload: []byte(`{"note":"tick"}`)}
}

func sumStats(is ...*instance) scheduler.Stats {
	var s scheduler.Stats
	for _, i := range is {
		st := i.Stats()
		s.Enqueued += st.Enqueued
		s.Existed += st.Existed
		s.Failed += st.Failed
	}
	return s
}

// seconds returns the n ticks of an every-second entry after t0.
func seconds(n int) []time.Time {
	out := make([]time.Time, n)
	for i := range out {
		out[i] = t0.Add(time.Duration(i+1) * time.Second)
	}
	return out
}

// Three instances on one clock wake together at each tick and race to
// enqueue it: the ledger keeps one job per tick.
func TestInstancesEnqueueEachTickOnce(t *testing.T) {
	b := setup(t)
	clock := newFakeClock(t0)
	cfg := scheduler.Config{Entries: []scheduler.Entry{everySecond("fleet")}, Clock: clock}
	fleet := []*instance{b.start(t, cfg), b.start(t, cfg), b.start(t, cfg)}
	runUntil(t, clock, t0.Add(10*time.Second), fleet...)
	for _, in := range fleet {
		in.stop()
	}

	require.Equal(t, seconds(10), b.ticks(t, "fleet"))
	require.Equal(t, scheduler.Stats{Enqueued: 10, Existed: 20}, sumStats(fleet...),
		"each tick created by one instance and found by the two others")
	require.Equal(t, 10, b.pending(t, "default"), "one task in Redis per tick")
}

// Instances stop and start in turn, one always running: every tick has one
// job, none missing across the hand-overs.
func TestRestartedInstanceNeitherRepeatsNorMissesTicks(t *testing.T) {
	b := setup(t)
	clock := newFakeClock(t0)
	cfg := scheduler.Config{Entries: []scheduler.Entry{everySecond("restart")}, Clock: clock}
	at := func(d time.Duration) time.Time { return t0.Add(d) }
	a := b.start(t, cfg)
	bb := b.start(t, cfg)
	runUntil(t, clock, at(2500*time.Millisecond), a, bb)
	a.stop() // bb alone
	runUntil(t, clock, at(5*time.Second), bb)
	a2 := b.start(t, cfg)
	runUntil(t, clock, at(6500*time.Millisecond), a2, bb)
	bb.stop() // a2 alone
	runUntil(t, clock, at(9*time.Second), a2)
	b2 := b.start(t, cfg)
	runUntil(t, clock, at(11*time.Second), a2, b2)
	a2.stop()
	b2.stop()

	require.Equal(t, seconds(11), b.ticks(t, "restart"))
	st := sumStats(a, bb, a2, b2)
	require.Equal(t, uint64(11), st.Enqueued, "each tick created once: %+v", st)
	require.Zero(t, st.Failed)
	require.Equal(t, 11, b.pending(t, "default"), "one task in Redis per tick")
}

// t0 is the fake clock's start: half a minute before a minute tick.
var t0 = time.Date(2030, 1, 1, 0, 0, 30, 0, time.UTC)

func minute(m int) time.Time { return time.Date(2030, 1, 1, 0, m, 0, 0, time.UTC) }

func everyMinute(name string) scheduler.Entry {
	return scheduler.Entry{Name: name, Spec: "@every 1m", Kind: tickKind.Name()}
}

func TestMissedTicksAfterDowntimeFollowThePolicy(t *testing.T) {
	for _, tc := range []struct {
		name       string
		policy     scheduler.MissedTicks
		maxCatchUp int
		want       []time.Time
	}{
		{"catch-up 2", scheduler.CatchUp, 2, []time.Time{minute(1), minute(5), minute(6), minute(7)}},
		{"default: catch-up 1", scheduler.CatchUp, 0, []time.Time{minute(1), minute(6), minute(7)}},
		{"skip", scheduler.Skip, 0, []time.Time{minute(1), minute(7)}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := setup(t)
			entries := []scheduler.Entry{everyMinute("downtime")}
			clock := newFakeClock(t0)
			a := b.start(t, scheduler.Config{Entries: entries, Clock: clock})
			advance(t, clock, minute(1), a)
			require.Equal(t, []time.Time{minute(1)}, b.ticks(t, "downtime"))
			a.stop()

			// Every scheduler down for ticks 2 to 6; one starts at 6:30.
			clock = newFakeClock(minute(6).Add(30 * time.Second))
			cfg := scheduler.Config{Entries: entries, Clock: clock, MissedTicks: tc.policy, MaxCatchUp: tc.maxCatchUp}
			advance(t, clock, minute(7), b.start(t, cfg))
			require.Equal(t, tc.want, b.ticks(t, "downtime"))
		})
	}
}

func TestStaleScheduleTableDoesNotRunATickTwice(t *testing.T) {
	b := setup(t)
	entries := []scheduler.Entry{everyMinute("stale")}
	clock := newFakeClock(t0)
	a := b.start(t, scheduler.Config{Entries: entries, Clock: clock})
	tickMinutes(t, clock, 3, a)
	require.Len(t, b.ticks(t, "stale"), 3)
	a.stop()
	// As if the last writes to keel_schedule were lost.
	_, err := b.pool.Exec(context.Background(), `UPDATE keel_schedule SET last_tick = $1 WHERE entry = 'stale'`, minute(0))
	require.NoError(t, err)

	clock = newFakeClock(minute(3).Add(30 * time.Second))
	again := b.start(t, scheduler.Config{Entries: entries, Clock: clock, MaxCatchUp: 5})
	require.Equal(t, scheduler.Stats{Existed: 3}, again.Stats(), "ticks 1-3 caught up again and found in the ledger")
	require.Equal(t, []time.Time{minute(1), minute(2), minute(3)}, b.ticks(t, "stale"))
	require.Equal(t, 3, b.pending(t, "default"))
	var last time.Time
	require.NoError(t, b.pool.QueryRow(context.Background(), `SELECT last_tick FROM keel_schedule WHERE entry = 'stale'`).Scan(&last))
	require.True(t, last.Equal(minute(3)), "last tick %s", last)
}

func TestScheduleFileReloads(t *testing.T) {
	b := setup(t)
	path := filepath.Join(t.TempDir(), "schedule.yaml")
	write := func(body string) {
		t.Helper()
		// Written beside and renamed over, as the package doc advises.
		tmp := path + ".tmp"
		require.NoError(t, os.WriteFile(tmp, []byte(body), 0o600))
		require.NoError(t, os.Rename(tmp, path))
	}
	const first = `
entries:
  - name: first
    spec: "@every 1s"
    kind: test:scheduler_tick
`
	write(first)
	clock := newFakeClock(t0)
	// The watcher checks the file on real time: the test waits for what it
	// found, not for the interval.
	s := b.start(t, scheduler.Config{File: path, FileCheckInterval: 50 * time.Millisecond, Clock: clock})
	advance(t, clock, t0.Add(time.Second), s)
	require.Equal(t, seconds(1), b.ticks(t, "first"))

	write(first + `
  - name: second
    spec: "* * * * * *"
    kind: test:scheduler_tick
    payload: {note: second}
`)
	require.NoError(t, s.signals.Reloaded.Wait(t))
	require.Len(t, s.Entries(), 2)
	s.signals.Synced.WaitFor(t, func(names []string) bool { return slices.Contains(names, "second") })
	advance(t, clock, t0.Add(2*time.Second), s)
	require.Equal(t, seconds(2)[1:], b.ticks(t, "second"), "the new entry ticks from its first tick after the reload")

	// A broken file is refused whole; both entries keep running.
	write(first + `
  - name: third
    spec: "* * *"
    kind: test:scheduler_tick
`)
	require.ErrorContains(t, s.signals.Reloaded.Wait(t), `bad spec "* * *"`)
	require.Equal(t, uint64(1), s.Stats().ReloadsRefused)
	require.Len(t, s.Entries(), 2)
	advance(t, clock, t0.Add(3*time.Second), s)
	require.Equal(t, seconds(3)[1:], b.ticks(t, "second"))
	require.Equal(t, seconds(3), b.ticks(t, "first"))
	require.Empty(t, b.ticks(t, "third"))

	// So is a file naming a kind nobody declared, on an explicit reload too.
	write(first + `
  - name: third
    spec: "@hourly"
    kind: test:nobody_handles_this
`)
	err := s.Reload()
	require.ErrorContains(t, err, path+`: schedule entry "third": unknown kind "test:nobody_handles_this"`)
	require.Len(t, s.Entries(), 2)

	write(first)
	require.NoError(t, s.Reload())
	require.Equal(t, []string{"first"}, names(s.Entries()))
}

func names(es []scheduler.Entry) []string {
	out := make([]string, len(es))
	for i, e := range es {
		out[i] = e.Name
	}
	return out
}

func TestConfigRefusesBadEntriesNamingThem(t *testing.T) {
	b := setup(t)
	client := b.client(t)
	entry := func(mod func(*scheduler.Entry)) []scheduler.Entry {
		e := scheduler.Entry{Name: "nightly-report", Spec: "0 2 * * *", Kind: tickKind.Name()}
		mod(&e)
		return []scheduler.Entry{e}
	}
	for _, tc := range []struct {
		name    string
		entries []scheduler.Entry
		field   string
		want    string
	}{
		{"bad spec", entry(func(e *scheduler.Entry) { e.Spec = "* * *" }), "spec",
			`schedule entry "nightly-report": bad spec "* * *": expected 5 to 6 fields, found 3`},
		{"bad time zone", entry(func(e *scheduler.Entry) { e.TimeZone = "Mars/Olympus_Mons" }), "timezone",
			`schedule entry "nightly-report": bad timezone "Mars/Olympus_Mons"`},
		{"unknown kind", entry(func(e *scheduler.Entry) { e.Kind = "report:nobody_declares_this" }), "kind",
			`schedule entry "nightly-report": unknown kind "report:nobody_declares_this"`},
		{"kind not the program's", entry(func(e *scheduler.Entry) { e.Kind = strayTick.Name() }), "kind",
			`schedule entry "nightly-report": unknown kind "test:scheduler_stray_tick"`},
		{"duplicate name", append(entry(func(*scheduler.Entry) {}), entry(func(*scheduler.Entry) {})...), "name",
			`schedule entry "nightly-report": duplicate name: entries #1 and #2`},
		{"zone twice", entry(func(e *scheduler.Entry) { e.TimeZone = "UTC"; e.Spec = "CRON_TZ=Asia/Tokyo 0 9 * * *" }), "spec",
			`time zone given twice`},
		{"zone prefix alone", entry(func(e *scheduler.Entry) { e.Spec = "TZ=UTC" }), "spec", `nothing after the time zone`},
		{"sub-second every", entry(func(e *scheduler.Entry) { e.Spec = "@every 1500ms" }), "spec", `whole number of seconds`},
		{"never ticks", entry(func(e *scheduler.Entry) { e.Spec = "0 0 30 2 *" }), "spec", `it never ticks`},
		{"bad name", entry(func(e *scheduler.Entry) { e.Name = "nightly report" }), "name", `bad name "nightly report"`},
		{"no name", entry(func(e *scheduler.Entry) { e.Name = "" }), "name", `schedule entry #1: bad name "": empty`},
		{"bad payload", entry(func(e *scheduler.Entry) { e.Payload = []byte(`{"a":`) }), "payload", `bad payload`},
		{"negative max retry", entry(func(e *scheduler.Entry) { n := -1; e.MaxRetry = &n }), "max_retry", `bad max_retry -1`},
		{"negative timeout", entry(func(e *scheduler.Entry) { e.Timeout = -time.Second }), "timeout", `bad timeout -1s`},
		// What the client would refuse at every tick is refused now.
		{"unknown queue", entry(func(e *scheduler.Entry) { e.Queue = "nosuch" }), "task", `unknown queue "nosuch"`},
		{"max retry too big", entry(func(e *scheduler.Entry) { n := math.MaxInt32; e.MaxRetry = &n }), "task", `max retry`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := scheduler.New(scheduler.Config{Client: client, Kinds: testKinds, Entries: tc.entries})
			require.ErrorContains(t, err, tc.want)
			require.ErrorIs(t, err, scheduler.ErrInvalidEntry)
			var ee *scheduler.EntryError
			require.ErrorAs(t, err, &ee)
			require.Equal(t, tc.field, ee.Field)
		})
	}

	// A check of the program's own, on every entry (the CLI decodes the
	// payload into the kind's type).
	_, err := scheduler.New(scheduler.Config{Client: client, Kinds: testKinds, Entries: entry(func(*scheduler.Entry) {}),
		CheckEntry: func(e scheduler.Entry) error { return errors.New("payload does not decode") }})
	require.ErrorContains(t, err, `schedule entry "nightly-report": payload does not decode`)
	require.ErrorIs(t, err, scheduler.ErrInvalidEntry)

	// The CLI's switch for kinds declared in other programs.
	_, err = scheduler.New(scheduler.Config{Client: client, KnownKind: scheduler.AnyKind,
		Entries: entry(func(e *scheduler.Entry) { e.Kind = "report:daily" })})
	require.NoError(t, err)

	for _, cfg := range []scheduler.Config{
		{},
		{Client: client, MaxCatchUp: -1},
		{Client: client, MissedTicks: 7},
		{Client: client, File: "x.yaml", Entries: entry(func(*scheduler.Entry) {})},
	} {
		_, err := scheduler.New(cfg)
		require.Error(t, err, "%+v", cfg)
	}
}

func TestRunTwiceAtOnceIsRefused(t *testing.T) {
	b := setup(t)
	clock := newFakeClock(t0)
	in := b.start(t, scheduler.Config{Entries: []scheduler.Entry{everyMinute("once")}, Clock: clock})
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	require.ErrorContains(t, in.Run(ctx), "already running")
}

func TestDowntimeBeforeTheFirstTickIsKnown(t *testing.T) {
	b := setup(t)
	entries := []scheduler.Entry{everyMinute("young")}
	clock := newFakeClock(t0)
	a := b.start(t, scheduler.Config{Entries: entries, Clock: clock})
	a.stop() // before its first tick

	clock = newFakeClock(minute(3).Add(30 * time.Second))
	b.start(t, scheduler.Config{Entries: entries, Clock: clock})
	require.Equal(t, []time.Time{minute(3)}, b.ticks(t, "young"), "the most recent missed tick caught up")
}

var uniqueTick = tasks.Define[tickPayload]("test:scheduler_unique_tick", tasks.Unique(time.Second),
	tasks.Key(func(p tickPayload) string { return p.Note }))

// A tick is one job for as long as the ledger keeps it, even of a kind whose
// tasks.Unique window lets a finished job's key be enqueued anew: a
// scheduler that catches up a tick already run (keel_schedule's writes
// lost, or two schedulers) finds it, instead of running it again.
func TestATickOfAKindWithAUniqueWindowRunsOnce(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	entries := []scheduler.Entry{{Name: "unique", Spec: "@every 1m", Kind: uniqueTick.Name()}}
	clock := newFakeClock(t0)
	a := b.start(t, scheduler.Config{Entries: entries, Clock: clock})
	tickMinutes(t, clock, 3, a)
	a.stop()
	// The ticks ran, long ago: past the kind's window.
	_, err := b.pool.Exec(ctx, `UPDATE keel_jobs SET status = 'succeeded', finished_at = now(),
		created_at = now() - interval '1 hour' WHERE kind = $1`, uniqueTick.Name())
	require.NoError(t, err)
	_, err = b.pool.Exec(ctx, `UPDATE keel_schedule SET last_tick = $1 WHERE entry = 'unique'`, minute(0))
	require.NoError(t, err)

	clock = newFakeClock(minute(3).Add(30 * time.Second))
	again := b.start(t, scheduler.Config{Entries: entries, Clock: clock, MaxCatchUp: 5})
	require.Equal(t, scheduler.Stats{Existed: 3}, again.Stats(), "ticks 1-3 caught up again and found in the ledger")
	var jobs, superseded int
	require.NoError(t, b.pool.QueryRow(ctx, `SELECT count(*), count(superseded_at) FROM keel_jobs WHERE kind = $1`,
		uniqueTick.Name()).Scan(&jobs, &superseded))
	require.Equal(t, 3, jobs, "jobs of three ticks")
	require.Zero(t, superseded)
}

// tickMinutes moves clock through minutes 1 to n, letting in fire each.
func tickMinutes(t *testing.T, clock *fakeClock, n int, in *instance) {
	t.Helper()
	for m := 1; m <= n; m++ {
		advance(t, clock, minute(m), in)
	}
}

// strayTick is declared in this process, but is not one of testKinds.
var strayTick = tasks.Define[tickPayload]("test:scheduler_stray_tick", tasks.Key(func(p tickPayload) string { return p.Note }))

var lowTick = tasks.Define[tickPayload]("test:scheduler_low_tick", tasks.Queue("low"), tasks.MaxRetry(2),
	tasks.Key(func(p tickPayload) string { return p.Note }))

// A tick of one of Config.Kinds takes the kind's defaults, as a task the
// program's code makes does.
func TestATickTakesItsKindsDefaults(t *testing.T) {
	b := setup(t)
	clock := newFakeClock(t0)
	a := b.start(t, scheduler.Config{Entries: []scheduler.Entry{{Name: "low", Spec: "@every 1m", Kind: lowTick.Name()}}, Clock: clock})
	tickMinutes(t, clock, 1, a)
	a.stop()
	var queue string
	var maxRetry int
	require.NoError(t, b.pool.QueryRow(context.Background(), `SELECT queue, max_retry FROM keel_jobs WHERE kind = $1`,
		lowTick.Name()).Scan(&queue, &maxRetry))
	require.Equal(t, "low", queue)
	require.Equal(t, 2, maxRetry)
}
