package metrics_test

import (
	"context"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/inspect"
	"github.com/keeljobs/keel/internal/testenv"
	"github.com/keeljobs/keel/metrics"
)

// The cron entries no scheduler fires (a tick more than the grace past
// due, not paused) and the paused ones, as the ledger has them.
func TestLedgerReportsScheduleEntries(t *testing.T) {
	pool, _ := testenv.PrivatePool(t)
	ctx := context.Background()
	ops, err := inspect.New(inspect.Config{Pool: pool})
	require.NoError(t, err)
	defer ops.Close()
	exec := func(sql string, args ...any) {
		t.Helper()
		_, err := pool.Exec(ctx, sql, args...)
		require.NoError(t, err)
	}
	// Run-time entries, every minute: added ten minutes ago with no tick
	// since (overdue), added now (its first tick within the minute),
	// paused, and one a scheduler ticks.
	for _, name := range []string{"minutely", "fresh", "frozen", "ticking"} {
		require.NoError(t, ops.AddSchedule(ctx, inspect.ScheduleEntry{Name: name, Spec: "* * * * *", Kind: "report"}, "ops", ""))
	}
	exec(`UPDATE keel_schedule_entries SET created_at = now() - interval '10 minutes', updated_at = now() - interval '10 minutes'
		WHERE name <> 'fresh'`)
	_, err = ops.PauseSchedule(ctx, "frozen", "ops", "freeze")
	require.NoError(t, err)
	// File entries, as schedulers described them: one every minute, one
	// paused, both last described ten minutes ago; one left every file two
	// days ago.
	exec(`INSERT INTO keel_schedule (entry, last_tick, spec, timezone, kind, seen_at) VALUES
		('ticking', date_trunc('minute', now()), '* * * * *', '', 'report', now() - interval '10 minutes'),
		('file-minutely', now() - interval '10 minutes', '@every 1m', '', 'report', now() - interval '10 minutes'),
		('file-paused', now() - interval '10 minutes', '@every 1m', '', 'report', now() - interval '10 minutes'),
		('file-gone', now() - interval '2 days', '@every 1m', '', 'report', now() - interval '2 days')`)
	_, err = ops.PauseSchedule(ctx, "file-paused", "ops", "freeze")
	require.NoError(t, err)

	l := newLedger(t, metrics.LedgerConfig{Pool: pool})
	reg := prometheus.NewRegistry()
	reg.MustRegister(l)
	gauges := func(paused, overdue string) string {
		return `
# HELP keel_schedule_entries Cron entries by state: paused (by a person), or overdue (not paused, and a tick more than the grace past due: no scheduler fires it).
# TYPE keel_schedule_entries gauge
keel_schedule_entries{state="overdue"} ` + overdue + `
keel_schedule_entries{state="paused"} ` + paused + `
`
	}
	// No scheduler has said anything for ten minutes: the file entries it
	// ran last are overdue too, not the one that left the files before.
	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(gauges("2", "2")), "keel_schedule_entries"))

	// A scheduler runs again: file entries it no longer describes have
	// left its files; the run-time entry it has not fired stays overdue.
	exec(`UPDATE keel_schedule SET seen_at = now(), last_tick = date_trunc('minute', now()) WHERE entry = 'ticking'`)
	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(gauges("1", "1")), "keel_schedule_entries"))

	// Its first tick fired, the minutely entry is no longer overdue; a
	// pause makes it paused instead.
	exec(`INSERT INTO keel_schedule (entry, last_tick, seen_at) VALUES ('minutely', date_trunc('minute', now()), now())`)
	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(gauges("1", "0")), "keel_schedule_entries"))
	_, err = ops.PauseSchedule(ctx, "minutely", "ops", "freeze")
	require.NoError(t, err)
	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(gauges("2", "0")), "keel_schedule_entries"))
}
