package ledger_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/internal/ledger"
)

func TestSchedulePlans(t *testing.T) {
	ctx := context.Background()
	now := time.Now()
	p := plan(t, func(db ledger.DB) {
		ledger.LoadSchedule(ctx, db, []string{"entry1", "entry2", "new"}, []time.Time{now, now, now}, []string{"@hourly", "@hourly", "@hourly"}, []string{"", "", ""}) //nolint:errcheck
	})
	usesIndex(t, p, []string{"keel_schedule_pkey"}, "keel_schedule")
	p = plan(t, func(db ledger.DB) { ledger.MarkTick(ctx, db, "entry7", now) }) //nolint:errcheck
	usesIndex(t, p, []string{"Arbiter Indexes: keel_schedule_pkey"})
}

// A loaded entry without a row gets one at the time given; a tick never
// moves back.
func TestScheduleTicks(t *testing.T) {
	ctx := context.Background()
	tx, err := big.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck
	t0 := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	got, err := ledger.LoadSchedule(ctx, tx, []string{"a"}, []time.Time{t0}, []string{"@hourly"}, []string{""})
	require.NoError(t, err)
	require.Empty(t, got, "the row is created, not returned")
	got, err = ledger.LoadSchedule(ctx, tx, []string{"a"}, []time.Time{t0.Add(time.Hour)}, []string{"@hourly"}, []string{""})
	require.NoError(t, err)
	require.True(t, got["a"].Tick.Equal(t0), got)
	require.NoError(t, ledger.MarkTick(ctx, tx, "a", t0.Add(2*time.Minute)))
	require.NoError(t, ledger.MarkTick(ctx, tx, "a", t0.Add(time.Minute)))
	got, err = ledger.LoadSchedule(ctx, tx, []string{"a"}, []time.Time{t0}, []string{"@hourly"}, []string{""})
	require.NoError(t, err)
	require.True(t, got["a"].Tick.Equal(t0.Add(2*time.Minute)), got)
}

func TestScheduleEntryPlans(t *testing.T) {
	ctx := context.Background()
	e := ledger.ScheduleEntry{Name: "entry7", Spec: "@hourly", Kind: "k", Payload: []byte(`{}`)}
	for _, call := range []func(db ledger.DB){
		func(db ledger.DB) { ledger.AddScheduleEntry(ctx, db, e, "ops", "why") },           //nolint:errcheck
		func(db ledger.DB) { ledger.UpdateScheduleEntry(ctx, db, e, "ops", "why") },        //nolint:errcheck
		func(db ledger.DB) { ledger.RemoveScheduleEntry(ctx, db, "entry7", "ops", "why") }, //nolint:errcheck
		func(db ledger.DB) { ledger.PauseSchedule(ctx, db, "entry7", "ops", "why") },       //nolint:errcheck
		func(db ledger.DB) { ledger.ResumeSchedule(ctx, db, "entry7", "ops", "why") },      //nolint:errcheck
	} {
		lacks(t, plan(t, call), "Seq Scan on keel_schedule ")
	}
	p := plan(t, func(db ledger.DB) {
		ledger.DescribeSchedule(ctx, db, []string{"entry1", "entry2"}, []string{"@hourly", "@daily"}, []string{"", ""}, []string{"k", "k"}, time.Now()) //nolint:errcheck
	})
	usesIndex(t, p, []string{"keel_schedule_pkey"}, "keel_schedule")
	p = plan(t, func(db ledger.DB) {
		ledger.TickJobs(ctx, db, []string{"kind1", "kind2"}, []string{"key8", "key9"}) //nolint:errcheck
	})
	usesIndex(t, p, []string{"keel_jobs_kind_business_key"}, "keel_jobs")
	// The metrics read every entry: the schedule's tables, whole, once.
	p = plan(t, func(db ledger.DB) { ledger.ScheduleRows(ctx, db) }) //nolint:errcheck
	usesIndex(t, p, []string{"Full Join", "keel_schedule_entries", "keel_schedule_pauses"})
}

// Run-time entries are added once, changed, removed with their pause and
// tick, and every change is audited.
func TestScheduleEntries(t *testing.T) {
	ctx := context.Background()
	tx, err := big.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck
	retries := 2
	e := ledger.ScheduleEntry{Name: "rt", Spec: "@every 1m", Kind: "k", Payload: []byte(`{"a": "x\ny"}`), MaxRetry: &retries, TimeoutMS: 1500}
	require.NoError(t, ledger.MarkTick(ctx, tx, "rt", time.Now()))
	done, err := ledger.AddScheduleEntry(ctx, tx, e, "ops:ann", "nightly report")
	require.NoError(t, err)
	require.True(t, done)
	states, err := ledger.ScheduleStates(ctx, tx)
	require.NoError(t, err)
	for _, s := range states {
		require.NotEqual(t, "rt", s.Entry, "an added entry starts afresh")
	}
	done, err = ledger.AddScheduleEntry(ctx, tx, e, "ops:bo", "again")
	require.NoError(t, err)
	require.False(t, done)
	got, err := ledger.ScheduleEntries(ctx, tx)
	require.NoError(t, err)
	require.Len(t, got, 1)
	require.JSONEq(t, `{"a": "x\ny"}`, string(got[0].Payload))
	require.Equal(t, 2, *got[0].MaxRetry)
	require.Equal(t, int64(1500), got[0].TimeoutMS)
	require.Equal(t, "ops:ann", got[0].CreatedBy)

	e.Spec, e.MaxRetry = "@every 2m", nil
	done, err = ledger.UpdateScheduleEntry(ctx, tx, e, "ops:bo", "slower")
	require.NoError(t, err)
	require.True(t, done)
	got, err = ledger.ScheduleEntries(ctx, tx)
	require.NoError(t, err)
	require.Equal(t, "@every 2m", got[0].Spec)
	require.Nil(t, got[0].MaxRetry)
	require.Equal(t, "ops:bo", got[0].UpdatedBy)

	done, err = ledger.PauseSchedule(ctx, tx, "rt", "ops:bo", "hold")
	require.NoError(t, err)
	require.True(t, done)
	done, err = ledger.PauseSchedule(ctx, tx, "rt", "ops:bo", "hold")
	require.NoError(t, err)
	require.False(t, done)
	ps, err := ledger.SchedulePauses(ctx, tx)
	require.NoError(t, err)
	require.Equal(t, []string{"rt"}, []string{ps[0].Entry})
	require.NoError(t, ledger.MarkTick(ctx, tx, "rt", time.Now()))
	done, err = ledger.RemoveScheduleEntry(ctx, tx, "rt", "ops:cy", "gone")
	require.NoError(t, err)
	require.True(t, done)
	ps, err = ledger.SchedulePauses(ctx, tx)
	require.NoError(t, err)
	require.Empty(t, ps, "the pause goes with the entry")
	done, err = ledger.UpdateScheduleEntry(ctx, tx, e, "ops:bo", "slower")
	require.NoError(t, err)
	require.False(t, done)
	var audited []string
	rows, err := tx.Query(ctx, `SELECT action || ' ' || actor FROM keel_audit WHERE action LIKE '%-schedule:rt' ORDER BY id`)
	require.NoError(t, err)
	audited, err = pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	require.Equal(t, []string{"add-schedule:rt ops:ann", "set-schedule:rt ops:bo", "pause-schedule:rt ops:bo", "remove-schedule:rt ops:cy"}, audited)
}

// A scheduler's description of its entries lands in their rows, and is
// written again only when it changes or is a minute old.
func TestDescribeSchedule(t *testing.T) {
	ctx := context.Background()
	tx, err := big.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck
	_, err = ledger.LoadSchedule(ctx, tx, []string{"d1"}, []time.Time{time.Now()}, []string{"@daily"}, []string{""})
	require.NoError(t, err)
	n, err := ledger.DescribeSchedule(ctx, tx, []string{"d1", "nope"}, []string{"@daily", "@daily"}, []string{"Europe/Berlin", ""}, []string{"k", "k"}, time.Now())
	require.NoError(t, err)
	require.Equal(t, int64(1), n)
	n, err = ledger.DescribeSchedule(ctx, tx, []string{"d1"}, []string{"@daily"}, []string{"Europe/Berlin"}, []string{"k"}, time.Now())
	require.NoError(t, err)
	require.Equal(t, int64(0), n, "unchanged and fresh")
	states, err := ledger.ScheduleStates(ctx, tx)
	require.NoError(t, err)
	var found bool
	for _, s := range states {
		if s.Entry == "d1" {
			found = true
			require.Equal(t, "@daily", *s.Spec)
			require.Equal(t, "Europe/Berlin", s.TimeZone)
			require.NotNil(t, s.SeenAt)
		}
	}
	require.True(t, found)

	// A changed spec moves the last tick up to the describer's now, and
	// only up: an unchanged one, or one no scheduler had described (an
	// older one's row), keeps its place.
	t0 := time.Date(2031, 1, 1, 0, 0, 0, 0, time.UTC)
	_, err = tx.Exec(ctx, `UPDATE keel_schedule SET last_tick = $1 WHERE entry = 'd1'`, t0)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, `INSERT INTO keel_schedule (entry, last_tick) VALUES ('older', $1)`, t0)
	require.NoError(t, err)
	last := func(entry string) time.Time {
		var at time.Time
		require.NoError(t, tx.QueryRow(ctx, `SELECT last_tick FROM keel_schedule WHERE entry = $1`, entry).Scan(&at))
		return at
	}
	_, err = ledger.DescribeSchedule(ctx, tx, []string{"d1", "older"}, []string{"@daily", "@hourly"}, []string{"Europe/Berlin", ""},
		[]string{"k", "k"}, t0.Add(time.Hour))
	require.NoError(t, err)
	require.True(t, last("d1").Equal(t0), "unchanged: %s", last("d1"))
	require.True(t, last("older").Equal(t0), "first described: %s", last("older"))
	_, err = ledger.DescribeSchedule(ctx, tx, []string{"d1", "older"}, []string{"@hourly", "@daily"}, []string{"Europe/Berlin", ""},
		[]string{"k", "k"}, t0.Add(2*time.Hour))
	require.NoError(t, err)
	require.True(t, last("d1").Equal(t0.Add(2*time.Hour)), "changed: %s", last("d1"))
	require.True(t, last("older").Equal(t0.Add(2*time.Hour)), "changed: %s", last("older"))
	_, err = ledger.DescribeSchedule(ctx, tx, []string{"d1"}, []string{"@daily"}, []string{"Europe/Berlin"}, []string{"k"}, t0)
	require.NoError(t, err)
	require.True(t, last("d1").Equal(t0.Add(2*time.Hour)), "never back: %s", last("d1"))
}
