package scheduler_test

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/inspect"
	"github.com/keeljobs/keel/internal/ledger"
	"github.com/keeljobs/keel/scheduler"
)

// ops is the operator API on b's ledger.
func (b *bundle) ops(t *testing.T) *inspect.Inspector {
	t.Helper()
	ops, err := inspect.New(inspect.Config{Pool: b.pool, KnownKind: testKinds.Known})
	require.NoError(t, err)
	t.Cleanup(func() { ops.Close() })
	return ops
}

// refresh makes each of ins read the ledger now and waits until Run runs
// what it read, as match says.
func refresh(t *testing.T, match func(names []string) bool, ins ...*instance) {
	t.Helper()
	for _, in := range ins {
		require.NoError(t, in.Refresh(context.Background()))
		in.signals.Synced.WaitFor(t, match)
	}
}

func has(name string) func([]string) bool {
	return func(names []string) bool { return slices.Contains(names, name) }
}

func lacks(name string) func([]string) bool {
	return func(names []string) bool { return !slices.Contains(names, name) }
}

// A run-time entry added through the operator API runs on both
// schedulers, one job per tick; a new spec, a pause, a resume and the
// removal reach both; a pause outlives a restart of every scheduler; each
// change is audited.
func TestRuntimeEntryOnTwoSchedulers(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	ops := b.ops(t)
	clock := newFakeClock(t0)
	// The poller is left out (a poll an hour away): Refresh is the poll.
	// beat wakes the schedulers every second, for runUntil.
	cfg := scheduler.Config{Clock: clock, Poll: time.Hour, Entries: []scheduler.Entry{everySecond("beat")}}
	a, bb := b.start(t, cfg), b.start(t, cfg)
	at := func(s int) time.Time { return t0.Add(time.Duration(s) * time.Second) }

	rt := inspect.ScheduleEntry{Name: "rt", Spec: "* * * * * *", Kind: tickKind.Name(), Payload: []byte(`{"note":"rt"}`)}
	require.NoError(t, ops.AddSchedule(ctx, rt, "ops:ann", "every second"))
	require.ErrorIs(t, ops.AddSchedule(ctx, rt, "ops:ann", "twice"), inspect.ErrScheduleExists)
	refresh(t, has("rt"), a, bb)
	runUntil(t, clock, at(5), a, bb)
	require.Equal(t, seconds(5), b.ticks(t, "rt"))
	// One job per tick is what counts (ticks above); on a loaded host the
	// second instance has been seen to report one tick fewer as existing.
	st := sumStats(a, bb)
	require.Equal(t, []uint64{10, 0}, []uint64{st.Enqueued, st.Failed}, "beat's ticks and rt's: %+v", st)
	require.GreaterOrEqual(t, st.Existed, uint64(9), "%+v", st)

	rt.Spec = "*/2 * * * * *"
	require.NoError(t, ops.SetSchedule(ctx, rt, "ops:bo", "every two seconds"))
	refresh(t, has("rt"), a, bb)
	runUntil(t, clock, at(10), a, bb)
	want := append(seconds(5), at(6), at(8), at(10))
	require.Equal(t, want, b.ticks(t, "rt"), "the new spec's ticks, on both")

	done, err := ops.PauseSchedule(ctx, "rt", "ops:cy", "supplier down")
	require.NoError(t, err)
	require.True(t, done)
	refresh(t, lacks("rt"), a, bb)
	runUntil(t, clock, at(14), a, bb)
	require.Equal(t, want, b.ticks(t, "rt"), "no job while paused")
	require.Equal(t, uint64(4), a.Stats().Paused+bb.Stats().Paused, "12 and 14 skipped on each")
	s, err := ops.Schedule(ctx, "rt")
	require.NoError(t, err)
	require.NotNil(t, s.Paused)
	require.Equal(t, "ops:cy", s.Paused.PausedBy)
	require.Nil(t, s.NextTick, "no next tick while paused")
	require.True(t, s.LastTick.Equal(at(14)), "the paused ticks are handled: %v", s.LastTick)

	done, err = ops.ResumeSchedule(ctx, "rt", "ops:cy", "supplier back")
	require.NoError(t, err)
	require.True(t, done)
	refresh(t, has("rt"), a, bb)
	runUntil(t, clock, at(18), a, bb)
	want = append(want, at(16), at(18))
	require.Equal(t, want, b.ticks(t, "rt"), "the ticks after the resume, none of the paused ones")

	// Paused, every scheduler stops; one starts: it finds the pause.
	_, err = ops.PauseSchedule(ctx, "rt", "ops:cy", "again")
	require.NoError(t, err)
	refresh(t, lacks("rt"), a, bb)
	a.stop()
	bb.stop()
	c := b.start(t, cfg)
	runUntil(t, clock, at(24), c)
	require.Equal(t, want, b.ticks(t, "rt"), "the pause outlives the restart")
	_, err = ops.ResumeSchedule(ctx, "rt", "ops:cy", "go")
	require.NoError(t, err)
	refresh(t, has("rt"), c)
	runUntil(t, clock, at(26), c)
	want = append(want, at(26))
	require.Equal(t, want, b.ticks(t, "rt"))

	s, err = ops.Schedule(ctx, "rt")
	require.NoError(t, err)
	require.Equal(t, inspect.SourceLedger, s.Source)
	require.Equal(t, "ops:ann", s.CreatedBy)
	require.Len(t, s.Ticks, 5)
	require.True(t, s.Ticks[0].At.Equal(at(26)))
	require.NotEmpty(t, s.Ticks[0].JobID, "the job the last tick made")
	require.Empty(t, s.Ticks[1].JobID, "24 ticked while paused")

	require.NoError(t, ops.RemoveSchedule(ctx, "rt", "ops:dee", "not needed"))
	refresh(t, lacks("rt"), c)
	runUntil(t, clock, at(30), c)
	require.Equal(t, want, b.ticks(t, "rt"), "no tick after the removal")
	_, err = ops.Schedule(ctx, "rt")
	require.ErrorIs(t, err, inspect.ErrNotFound)

	rows, err := b.pool.Query(ctx, `SELECT action || ' ' || actor || ': ' || note FROM keel_audit WHERE action LIKE '%-schedule:rt' ORDER BY id`)
	require.NoError(t, err)
	audit, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	require.Equal(t, []string{
		"add-schedule:rt ops:ann: every second",
		"set-schedule:rt ops:bo: every two seconds",
		"pause-schedule:rt ops:cy: supplier down",
		"resume-schedule:rt ops:cy: supplier back",
		"pause-schedule:rt ops:cy: again",
		"resume-schedule:rt ops:cy: go",
		"remove-schedule:rt ops:dee: not needed",
	}, audit)
}

// Without Refresh, the poller brings a change to every running scheduler.
func TestPollerPicksUpChanges(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	ops := b.ops(t)
	clock := newFakeClock(t0)
	cfg := scheduler.Config{Clock: clock, Poll: 50 * time.Millisecond}
	a, bb := b.start(t, cfg), b.start(t, cfg)
	require.NoError(t, ops.AddSchedule(ctx, inspect.ScheduleEntry{Name: "polled", Spec: "@every 1m", Kind: tickKind.Name()}, "ops", ""))
	for _, in := range []*instance{a, bb} {
		in.signals.Synced.WaitFor(t, has("polled"))
	}
	_, err := ops.PauseSchedule(ctx, "polled", "ops", "")
	require.NoError(t, err)
	for _, in := range []*instance{a, bb} {
		in.signals.Synced.WaitFor(t, lacks("polled"))
	}
}

// A file or code entry: the ledger knows its spec once a scheduler runs
// it, refuses a run-time entry of its name, and pauses it like any. A
// run-time entry of that name written all the same is not run.
func TestConfigEntryInTheLedger(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	ops := b.ops(t)
	clock := newFakeClock(t0)
	cfg := scheduler.Config{Clock: clock, Poll: time.Hour, Entries: []scheduler.Entry{everySecond("file")}}
	a := b.start(t, cfg)
	require.NoError(t, a.Refresh(ctx)) // says what its entries are
	runUntil(t, clock, t0.Add(2*time.Second), a)

	s, err := ops.Schedule(ctx, "file")
	require.NoError(t, err)
	require.Equal(t, inspect.SourceConfig, s.Source)
	require.Equal(t, "* * * * * *", s.Spec)
	require.Equal(t, tickKind.Name(), s.Kind)
	require.NotNil(t, s.SeenAt)
	require.True(t, s.Running(time.Now()), "a scheduler runs it")
	require.NotNil(t, s.NextTick)
	require.True(t, s.Ticks[0].At.Equal(t0.Add(2*time.Second)))
	require.NotEmpty(t, s.Ticks[0].JobID)

	err = ops.AddSchedule(ctx, inspect.ScheduleEntry{Name: "file", Spec: "@hourly", Kind: tickKind.Name()}, "ops", "")
	require.ErrorIs(t, err, inspect.ErrScheduleExists)
	require.ErrorIs(t, ops.RemoveSchedule(ctx, "file", "ops", ""), inspect.ErrScheduleConfigured)
	err = ops.AddSchedule(ctx, inspect.ScheduleEntry{Name: "odd", Spec: "@hourly", Kind: "no:such_kind"}, "ops", "")
	require.ErrorContains(t, err, "unknown kind")
	err = ops.AddSchedule(ctx, inspect.ScheduleEntry{Name: "odd", Spec: "*/90 * * * *", Kind: tickKind.Name()}, "ops", "")
	require.ErrorContains(t, err, "@every")
	require.ErrorIs(t, ops.AddSchedule(ctx, inspect.ScheduleEntry{Name: "odd", Spec: "@hourly", Kind: tickKind.Name()}, "", ""), inspect.ErrActorRequired)

	_, err = ledger.AddScheduleEntry(ctx, b.pool, ledger.ScheduleEntry{Name: "file", Spec: "@hourly", Kind: tickKind.Name(), Payload: []byte(`{}`)}, "ops", "")
	require.NoError(t, err)
	require.NoError(t, a.Refresh(ctx))
	require.Equal(t, []scheduler.Entry{everySecond("file")}, a.Entries(), "the file's entry runs")

	_, err = ops.PauseSchedule(ctx, "file", "ops", "")
	require.NoError(t, err)
	refresh(t, lacks("file"), a)
	runUntil(t, clock, t0.Add(4*time.Second), a)
	require.Equal(t, seconds(2), b.ticks(t, "file"))
}

// A run-time entry this scheduler cannot run (its kind is another
// program's) is left out; the others run.
func TestRuntimeEntryOfAnUnknownKind(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	clock := newFakeClock(t0)
	a := b.start(t, scheduler.Config{Clock: clock, Poll: time.Hour})
	_, err := ledger.AddScheduleEntry(ctx, b.pool, ledger.ScheduleEntry{Name: "theirs", Spec: "* * * * * *", Kind: "other:kind", Payload: []byte(`{}`)}, "ops", "")
	require.NoError(t, err)
	require.NoError(t, b.ops(t).AddSchedule(ctx, everySecondEntry("ours"), "ops", ""))
	refresh(t, func(names []string) bool { return slices.Equal(names, []string{"ours"}) }, a)
	runUntil(t, clock, t0.Add(2*time.Second), a)
	require.Equal(t, seconds(2), b.ticks(t, "ours"))
	require.Equal(t, []string{"ours"}, names(a.Entries()))
}

func everySecondEntry(name string) inspect.ScheduleEntry {
	return inspect.ScheduleEntry(everySecond(name))
}

// A change of a run-time entry's task (its payload here) applies from the
// next tick, keeping the entry's place: no tick missed or repeated.
func TestRuntimeEntryTaskChange(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	ops := b.ops(t)
	clock := newFakeClock(t0)
	a := b.start(t, scheduler.Config{Clock: clock, Poll: time.Hour})
	e := everySecondEntry("task")
	e.Payload = []byte(`{"note":"one"}`)
	require.NoError(t, ops.AddSchedule(ctx, e, "ops", ""))
	refresh(t, has("task"), a)
	runUntil(t, clock, t0.Add(2*time.Second), a)
	e.Payload = []byte(`{"note":"two"}`)
	require.NoError(t, ops.SetSchedule(ctx, e, "ops", "new note"))
	refresh(t, has("task"), a)
	runUntil(t, clock, t0.Add(4*time.Second), a)

	require.Equal(t, seconds(4), b.ticks(t, "task"))
	var notes []string
	for _, tick := range seconds(4) {
		var note string
		require.NoError(t, b.pool.QueryRow(ctx, `SELECT convert_from(payload, 'UTF8')::jsonb->>'note' FROM keel_jobs WHERE business_key = $1`,
			scheduler.TickKey("task", tick)).Scan(&note))
		notes = append(notes, note)
	}
	require.Equal(t, []string{"one", "one", "two", "two"}, notes)
}
