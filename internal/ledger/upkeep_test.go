package ledger_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/internal/ledger"
)

// The upkeep statements must stay on their partial indexes as the ledger
// grows.
func TestUpkeepPlans(t *testing.T) {
	ctx := context.Background()
	retention := 30 * 24 * time.Hour
	p := plan(t, func(db ledger.DB) { ledger.PruneBatches(ctx, db, retention, 1000, nil) }) //nolint:errcheck
	usesIndex(t, p, []string{"keel_batches_completed", "keel_jobs_batch"})
	lacks(t, p, "Seq Scan")
	p = plan(t, func(db ledger.DB) { ledger.PruneKind(ctx, db, "kind3", "succeeded", retention, 1000, nil) }) //nolint:errcheck
	usesIndex(t, p, []string{"keel_jobs_finished_kind"}, "keel_jobs")
	p = plan(t, func(db ledger.DB) { ledger.ReconcilePage(ctx, db, time.Second, "", 500, nil) }) //nolint:errcheck
	usesIndex(t, p, []string{"keel_jobs_open"}, "keel_jobs")
	p = plan(t, func(db ledger.DB) { ledger.RescuePage(ctx, db, "", 500, nil) }) //nolint:errcheck
	usesIndex(t, p, []string{"keel_jobs_running_lease"})
	p = plan(t, func(db ledger.DB) { ledger.OwedAlerts(ctx, db, time.Second, 500, nil) }) //nolint:errcheck
	usesIndex(t, p, []string{"keel_jobs_alert_owed"}, "keel_jobs")
	// The prune log holds a week of prunes, one row each: its trim may
	// read it whole (the fixture's log is mostly older than a week).
	p = plan(t, func(db ledger.DB) { ledger.LogPrune(ctx, db, 10, nil) }) //nolint:errcheck
	usesIndex(t, p, []string{"Insert on keel_prune_log"})
	p = plan(t, func(db ledger.DB) { ledger.TrimPruneLog(ctx, db, nil) }) //nolint:errcheck
	usesIndex(t, p, []string{"Delete on keel_prune_log"})
}

// The upkeep statements read the time they are given.
func TestUpkeepTakesNow(t *testing.T) {
	ctx := context.Background()
	tx, err := big.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck
	later := ledger.At(time.Now().Add(365 * 24 * time.Hour))
	_, err = tx.Exec(ctx, `INSERT INTO keel_jobs (id, kind, business_key, queue, payload, max_retry, status, published_at,
		lease_holder, lease_until, updated_at, finished_at)
		VALUES ('zrun', 'k', 'zrun', 'default', '\x7b7d', 3, 'running', now(), 'w', now() + interval '1 hour', now(), NULL),
			('zdone', 'k', 'zdone', 'default', '\x7b7d', 3, 'succeeded', now(), NULL, NULL, now(), now())`)
	require.NoError(t, err)

	page, err := ledger.ReconcilePage(ctx, tx, time.Minute, "z", 10, nil)
	require.NoError(t, err)
	require.Empty(t, page, "updated a moment ago: within the grace")
	page, err = ledger.ReconcilePage(ctx, tx, time.Minute, "z", 10, later)
	require.NoError(t, err)
	require.Equal(t, []ledger.OpenJob{{ID: "zrun", Queue: "default", Held: false}}, page, "a year on its lease ran out")

	orphans, err := ledger.RescuePage(ctx, tx, "z", 10, nil)
	require.NoError(t, err)
	require.Empty(t, orphans, "its lease runs an hour yet")
	orphans, err = ledger.RescuePage(ctx, tx, "z", 10, later)
	require.NoError(t, err)
	require.Equal(t, []ledger.Orphan{{ID: "zrun", Queue: "default", Holder: "w"}}, orphans)

	_, err = tx.Exec(ctx, `INSERT INTO keel_jobs (id, kind, business_key, queue, payload, max_retry, status, attempts,
		error_class, last_error, updated_at, finished_at, alert_owed)
		VALUES ('zdead', 'k', 'zdead', 'default', '\x7b7d', 3, 'dead', 2, 'permanent', 'boom', now(), now(), true)`)
	require.NoError(t, err)
	owed, err := ledger.OwedAlerts(ctx, tx, time.Minute, 100000, nil)
	require.NoError(t, err)
	require.NotContains(t, owed, ledger.Death{ID: "zdead", Kind: "k", Queue: "default", BusinessKey: "zdead",
		Class: "permanent", Error: "boom", Attempts: 2}, "died a moment ago: its worker's hook may still run")
	owed, err = ledger.OwedAlerts(ctx, tx, time.Minute, 100000, later)
	require.NoError(t, err)
	require.Contains(t, owed, ledger.Death{ID: "zdead", Kind: "k", Queue: "default", BusinessKey: "zdead",
		Class: "permanent", Error: "boom", Attempts: 2})
	require.NoError(t, ledger.AlertsPaid(ctx, tx, []string{"zdead"}))
	owed, err = ledger.OwedAlerts(ctx, tx, time.Minute, 100000, later)
	require.NoError(t, err)
	for _, d := range owed {
		require.NotEqual(t, "zdead", d.ID, "paid")
	}

	var n int
	count := func() int {
		require.NoError(t, tx.QueryRow(ctx, `SELECT count(*) FROM keel_jobs WHERE id = 'zdone'`).Scan(&n))
		return n
	}
	// Only what finished before the retention goes: zdone and every
	// finished job of the fixture, a year on; none of them now.
	require.Zero(t, pruneAll(t, tx, 100*24*time.Hour, nil))
	require.Equal(t, 1, count())
	require.Positive(t, pruneAll(t, tx, 100*24*time.Hour, later))
	require.Equal(t, 0, count())
	// A pruned job's dependencies as a child go with it; those naming a
	// pruned parent stay with their child.
	var childless, kept int
	require.NoError(t, tx.QueryRow(ctx, `SELECT count(*) FILTER (WHERE NOT EXISTS (SELECT 1 FROM keel_jobs c WHERE c.id = d.child_id)),
		count(*) FILTER (WHERE NOT EXISTS (SELECT 1 FROM keel_jobs p WHERE p.id = d.parent_id)) FROM keel_job_deps d`).Scan(&childless, &kept))
	require.Zero(t, childless, "dependencies of pruned children")
	require.Positive(t, kept, "dependencies on pruned parents, kept with their children")
	gone, err := ledger.PruneBatches(ctx, tx, 100*24*time.Hour, 100000, later)
	require.NoError(t, err)
	require.Positive(t, gone, "a year on, the batches whose members were pruned go")

	require.NoError(t, ledger.LogPrune(ctx, tx, 7, later))
	require.NoError(t, ledger.TrimPruneLog(ctx, tx, later))
	require.NoError(t, tx.QueryRow(ctx, `SELECT count(*) FROM keel_prune_log`).Scan(&n))
	require.Equal(t, 1, n, "a year on, only the entry logged then is younger than 7 days")
}

// pruneAll prunes every kind's finished jobs at keep, as a reconciler
// without policies does, and returns how many went.
func pruneAll(t *testing.T, db ledger.DB, keep time.Duration, now ledger.Now) int {
	t.Helper()
	ctx := context.Background()
	kinds, err := ledger.FinishedKinds(ctx, db)
	require.NoError(t, err)
	total := 0
	for _, kind := range kinds {
		for _, status := range []string{"succeeded", "discarded", "cancelled"} {
			n, err := ledger.PruneKind(ctx, db, kind, status, keep, 100000, now)
			require.NoError(t, err)
			total += n
		}
	}
	return total
}
