package ledger_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/internal/ledger"
)

// The harness's reads of keel_jobs that a filter narrows; the scale
// benchmark runs them on ledgers of millions of jobs.
func TestHarnessPlans(t *testing.T) {
	ctx := context.Background()
	p := plan(t, func(db ledger.DB) { ledger.RunningJobs(ctx, db) }) //nolint:errcheck
	usesIndex(t, p, []string{"keel_jobs_running_lease"}, "keel_jobs")
	// One kind's succeeded jobs: the per-kind prune's index serves as well.
	p = plan(t, func(db ledger.DB) { ledger.SucceededOfKind(ctx, db, "kind3") }) //nolint:errcheck
	if !strings.Contains(p, "keel_jobs_finished_kind") {
		usesIndex(t, p, []string{"keel_jobs_kind_business_key"}, "keel_jobs")
	}
	lacks(t, p, "Seq Scan on keel_jobs")
	p = plan(t, func(db ledger.DB) { ledger.KindTally(ctx, db, "kind3") }) //nolint:errcheck
	usesIndex(t, p, []string{"keel_jobs_kind_business_key"}, "keel_jobs")
	p = plan(t, func(db ledger.DB) { ledger.Unpublished(ctx, db) }) //nolint:errcheck
	usesIndex(t, p, []string{"keel_jobs_unpublished"}, "keel_jobs")
	p = plan(t, func(db ledger.DB) { ledger.FirstPending(ctx, db) }) //nolint:errcheck
	usesIndex(t, p, []string{"keel_jobs_open"}, "keel_jobs")
	p = plan(t, func(db ledger.DB) { ledger.FirstHeld(ctx, db, "worker-1") }) //nolint:errcheck
	usesIndex(t, p, []string{"keel_jobs_running_lease"}, "keel_jobs")
	p = plan(t, func(db ledger.DB) { ledger.WaitingJobs(ctx, db) }) //nolint:errcheck
	usesIndex(t, p, []string{"keel_jobs_open"}, "keel_jobs")
	p = plan(t, func(db ledger.DB) { ledger.Reconcilable(ctx, db, time.Minute) }) //nolint:errcheck
	usesIndex(t, p, []string{"keel_jobs_open"}, "keel_jobs")
}

// The catalog reads scan into the harness's values on the big ledger.
func TestHarnessCatalogReads(t *testing.T) {
	ctx := context.Background()
	z, err := ledger.JobsSize(ctx, big)
	require.NoError(t, err)
	require.Equal(t, int64(60800), z.Rows, "60,000 jobs, 200 waiting and 600 of a kind with a concurrency key")
	require.Positive(t, z.TableBytes)
	require.NotEmpty(t, z.Indexes)
	require.GreaterOrEqual(t, z.Indexes[0].Bytes, z.Indexes[len(z.Indexes)-1].Bytes, "largest first")
	_, err = ledger.JobsStats(ctx, big)
	require.NoError(t, err)
	_, err = ledger.JobsDeleted(ctx, big)
	require.NoError(t, err)
	a, err := ledger.JobsAutovacuum(ctx, big)
	require.NoError(t, err)
	require.Positive(t, a.NaptimeSeconds)
	_, _, err = ledger.Vacuuming(ctx, big)
	require.NoError(t, err)
}
