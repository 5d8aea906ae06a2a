package ledger_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/internal/ledger"
)

func TestStatsPlans(t *testing.T) {
	ctx := context.Background()
	p := plan(t, func(db ledger.DB) { ledger.DeadLetters(ctx, db) }) //nolint:errcheck
	usesIndex(t, p, []string{"keel_jobs_dead"}, "keel_jobs")
	// The open batches: by keel_batches_open where the complete ones
	// outweigh them, as in a ledger of months; on this one's 20,000 a
	// scan of the table may cost less.
	p = plan(t, func(db ledger.DB) { ledger.OpenBatches(ctx, db) }) //nolint:errcheck
	usesIndex(t, p, []string{"keel_batches"})
	p = plan(t, func(db ledger.DB) { ledger.WaitingByKind(ctx, db) }) //nolint:errcheck
	usesIndex(t, p, []string{"keel_jobs_waiting", "keel_job_deps_child"}, "keel_jobs", "keel_job_deps")
	// Prunable reads the policies (TestRetentionPlans) and counts by the
	// prune's own predicates, each on the prune's index.
	p = plan(t, func(db ledger.DB) { ledger.CountPastKeep(ctx, db, "kind3", "succeeded", 30*24*time.Hour, nil) }) //nolint:errcheck
	usesIndex(t, p, []string{"keel_jobs_finished_kind"}, "keel_jobs")
	// The prune log holds a week of prunes (the fixture's, 20 days): it is
	// read whole.
	p = plan(t, func(db ledger.DB) { ledger.Pruned(ctx, db, nil) }) //nolint:errcheck
	usesIndex(t, p, []string{"keel_prune_log"})
	p = plan(t, func(db ledger.DB) { ledger.NewestKeyOfKind(ctx, db, "kind3") }) //nolint:errcheck
	usesIndex(t, p, nil, "keel_jobs")
	// `keel ledger` counts every job by status, and the CLI's hint lists
	// the kinds: an operator's command, a scan of the table each.
	p = plan(t, func(db ledger.DB) { ledger.JobsByStatus(ctx, db) }) //nolint:errcheck
	usesIndex(t, p, []string{"keel_jobs"})
	p = plan(t, func(db ledger.DB) { ledger.Kinds(ctx, db) }) //nolint:errcheck
	usesIndex(t, p, []string{"keel_jobs"})
	p = plan(t, func(db ledger.DB) { ledger.LedgerSize(ctx, db) }) //nolint:errcheck
	usesIndex(t, p, []string{"Result"})
}

// The counts of `keel ledger` and the metrics, on the big ledger.
func TestStats(t *testing.T) {
	ctx := context.Background()
	tx, err := big.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck

	size, err := ledger.LedgerSize(ctx, tx)
	require.NoError(t, err)
	require.Positive(t, size)
	byStatus, err := ledger.JobsByStatus(ctx, tx)
	require.NoError(t, err)
	require.Equal(t, int64(30000), byStatus["succeeded"])
	require.Equal(t, int64(5000), byStatus["dead"])

	dead, err := ledger.DeadLetters(ctx, tx)
	require.NoError(t, err)
	var n int64
	for _, d := range dead {
		n += d.N
	}
	require.Equal(t, byStatus["dead"], n)
	require.Equal(t, "default", dead[0].Queue, "by queue, kind and class")

	open, sealed, err := ledger.OpenBatches(ctx, tx)
	require.NoError(t, err)
	require.Zero(t, open)
	require.Equal(t, int64(2000), sealed, "a tenth of the batches is still open, all sealed")

	// Finished 0 to 89 days ago: none 100 days; some 30.
	prunable, err := ledger.Prunable(ctx, tx, 100*24*time.Hour, 24*time.Hour, nil)
	require.NoError(t, err)
	require.Zero(t, prunable)
	prunable, err = ledger.Prunable(ctx, tx, 100*24*time.Hour, 24*time.Hour, ledger.At(time.Now().Add(365*24*time.Hour)))
	require.NoError(t, err)
	require.Equal(t, byStatus["succeeded"]+byStatus["discarded"]+byStatus["cancelled"], prunable)

	// The fixture's log: 1,000 rows an hour for the last 500 hours.
	day, week, err := ledger.Pruned(ctx, tx, nil)
	require.NoError(t, err)
	require.Equal(t, int64(23000), day)
	require.Equal(t, int64(167000), week)
	// Ten days ago, the last day is everything since 11 days ago.
	day, _, err = ledger.Pruned(ctx, tx, ledger.At(time.Now().Add(-10*24*time.Hour)))
	require.NoError(t, err)
	require.Equal(t, int64(263000), day)

	key, err := ledger.NewestKeyOfKind(ctx, tx, "kind3")
	require.NoError(t, err)
	require.Equal(t, "key60000", key)
	_, err = ledger.NewestKeyOfKind(ctx, tx, "nope")
	require.ErrorIs(t, err, pgx.ErrNoRows)
	kinds, err := ledger.Kinds(ctx, tx)
	require.NoError(t, err)
	require.Equal(t, []string{"kind0", "kind1", "kind2", "kind3", "kind4", "kind5", "kind6", "tenantkind"}, kinds)
}
