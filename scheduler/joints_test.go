package scheduler_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/inspect"
	"github.com/keeljobs/keel/scheduler"
)

// A changed spec starts the entry afresh, for the scheduler that picked it
// up and for any that starts later: a restart before the new spec's first
// tick does not catch up the new spec's ticks from before the change.
func TestASpecChangeStartsAfreshThroughARestart(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	ops := b.ops(t)
	clock := newFakeClock(t0)
	cfg := scheduler.Config{Clock: clock, Poll: time.Hour}
	a := b.start(t, cfg)
	rt := inspect.ScheduleEntry{Name: "rt", Spec: "0 * * * * *", Kind: tickKind.Name(), Payload: []byte(`{"note":"rt"}`)}
	require.NoError(t, ops.AddSchedule(ctx, rt, "ops:ann", ""))
	refresh(t, has("rt"), a)
	advance(t, clock, minute(1), a)
	require.Equal(t, []time.Time{minute(1)}, b.ticks(t, "rt"))

	clock.Set(minute(1).Add(40 * time.Second))
	rt.Spec = "30 * * * * *"
	require.NoError(t, ops.SetSchedule(ctx, rt, "ops:bo", "at :30 from now on"))
	refresh(t, has("rt"), a)
	clock.Set(minute(1).Add(45 * time.Second))
	require.Equal(t, []time.Time{minute(1)}, b.ticks(t, "rt"), "afresh: the next tick is 00:02:30")

	// A deploy: a scheduler starts before the new spec's first tick.
	a.stop()
	c := b.start(t, cfg)
	refresh(t, has("rt"), c)
	require.Equal(t, []time.Time{minute(1)}, b.ticks(t, "rt"), "the restart made a job for 00:01:30, before the spec changed")
	advance(t, clock, minute(2).Add(30*time.Second), c)
	require.Equal(t, []time.Time{minute(1), minute(2).Add(30 * time.Second)}, b.ticks(t, "rt"))
}

// A file or code entry whose spec changed while no scheduler ran starts
// afresh too: its old last tick is of another schedule. So it does on a
// scheduler that could not record the change before it read its ticks
// (its first read of the ledger's entries and pauses failed).
func TestAnEntryChangedWhileNoSchedulerRanStartsAfresh(t *testing.T) {
	for _, unreadable := range []bool{false, true} {
		t.Run(map[bool]string{false: "first refresh read", true: "first refresh failed"}[unreadable], func(t *testing.T) {
			b := setup(t)
			clock := newFakeClock(t0)
			old := everyMinute("report")
			a := b.start(t, scheduler.Config{Entries: []scheduler.Entry{old}, Clock: clock, Poll: time.Hour})
			advance(t, clock, minute(1), a)
			require.Equal(t, []time.Time{minute(1)}, b.ticks(t, "report"))
			a.stop()

			changed := old
			changed.Spec = "30 * * * * *"
			clock.Set(minute(3).Add(10 * time.Second))
			cfg := scheduler.Config{Entries: []scheduler.Entry{changed}, Clock: clock, Poll: time.Hour}
			var c *instance
			if unreadable {
				c = b.startWithPausesUnreadable(t, cfg)
			} else {
				c = b.start(t, cfg)
			}
			refresh(t, has("report"), c)
			require.Equal(t, []time.Time{minute(1)}, b.ticks(t, "report"), "ticks of the new spec from before it ran were caught up")
			if unreadable {
				advance(t, clock, minute(3).Add(30*time.Second), c)
				require.Equal(t, []time.Time{minute(1), minute(3).Add(30 * time.Second)}, b.ticks(t, "report"))
			}
		})
	}
}

// startWithPausesUnreadable starts a scheduler whose first read of the
// pauses fails (a ledger that comes back between the scheduler's first
// read of them and its first read of its ticks), and lets it read them
// again once it runs.
func (b *bundle) startWithPausesUnreadable(t *testing.T, cfg scheduler.Config) *instance {
	t.Helper()
	ctx := context.Background()
	_, err := b.pool.Exec(ctx, `ALTER TABLE keel_schedule_pauses RENAME TO keel_schedule_pauses_away`)
	require.NoError(t, err)
	c := b.start(t, cfg)
	_, err = b.pool.Exec(ctx, `ALTER TABLE keel_schedule_pauses_away RENAME TO keel_schedule_pauses`)
	require.NoError(t, err)
	return c
}

// A paused entry makes no job on a scheduler that could not read the
// pauses when it started, even once it can read its ticks.
func TestAPausedEntryWaitsForThePausesToBeRead(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	ops := b.ops(t)
	entries := []scheduler.Entry{everyMinute("fz")}
	clock := newFakeClock(t0)
	a := b.start(t, scheduler.Config{Entries: entries, Clock: clock, Poll: time.Hour})
	advance(t, clock, minute(1), a)
	_, err := ops.PauseSchedule(ctx, "fz", "ops:cy", "month-end freeze")
	require.NoError(t, err)
	refresh(t, lacks("fz"), a)
	advance(t, clock, minute(2), a)
	require.Equal(t, []time.Time{minute(1)}, b.ticks(t, "fz"))
	a.stop()

	clock = newFakeClock(minute(3).Add(30 * time.Second))
	c := b.startWithPausesUnreadable(t, scheduler.Config{Entries: entries, Clock: clock, Poll: time.Hour})
	require.Equal(t, []time.Time{minute(1)}, b.ticks(t, "fz"), "a paused entry made a job")
	refresh(t, lacks("fz"), c)
	advance(t, clock, minute(4), c)
	require.Equal(t, []time.Time{minute(1)}, b.ticks(t, "fz"), "a paused entry made a job")
	require.Zero(t, c.Stats().Enqueued)
}
