package ledger_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/internal/ledger"
)

// The guard's statements touch the rows of the jobs at hand, by primary
// key: none may read keel_jobs whole, however large the ledger.
func TestExecutorPlans(t *testing.T) {
	ctx := context.Background()
	ids := []string{"j00000008", "j00000020", "j00000032"} // running, pending, failed (see fill)
	runs := []int32{1, 1, 1}
	for _, batch := range []bool{false, true} {
		p := plan(t, func(db ledger.DB) {
			ledger.Round(ctx, db, ledger.RoundArgs{Holder: "worker-0", LeaseMS: 10000, Claim: ids[1:], //nolint:errcheck
				Done: ids[:1], DoneRuns: runs[:1], Batch: batch}, func(ledger.Claimed) {})
		})
		usesIndex(t, p, []string{"keel_jobs_pkey", "keel_jobs_strays"}, "keel_jobs", "keel_batches")
	}
	p := plan(t, func(db ledger.DB) { ledger.ReadUnclaimed(ctx, db, ids, func(ledger.Unclaimed) {}) }) //nolint:errcheck
	usesIndex(t, p, []string{"keel_jobs_pkey"}, "keel_jobs")
	p = plan(t, func(db ledger.DB) { ledger.Renew(ctx, db, "worker-0", 10000, ids, runs) }) //nolint:errcheck
	usesIndex(t, p, []string{"keel_jobs_pkey"}, "keel_jobs")
	for name, call := range map[string]func(db ledger.DB){
		"release": func(db ledger.DB) { ledger.Release(ctx, db, ids[0], "worker-0", 1) }, //nolint:errcheck
		"mark succeeded": func(db ledger.DB) {
			ledger.MarkSucceededAndCommit(ctx, db.(ledger.Batcher), ids[0], "worker-0", 1, nil) //nolint:errcheck
		},
		"retire crashed":      func(db ledger.DB) { ledger.RetireCrashed(ctx, db, ids[0], "") },         //nolint:errcheck
		"dead after complete": func(db ledger.DB) { ledger.DeadAfterComplete(ctx, db, ids[0], "", "") }, //nolint:errcheck
		"fail": func(db ledger.DB) {
			ledger.Fail(ctx, db, ledger.Failure{ID: ids[0], Holder: "worker-0", Run: 1, Status: ledger.StatusFailed, RunInMS: -1}) //nolint:errcheck
		},
	} {
		t.Run(name, func(t *testing.T) {
			// By id: the primary key, or keel_jobs_open, which holds the id
			// of every job not finished.
			usesIndex(t, plan(t, call), []string{"Index Cond: (id = "}, "keel_jobs")
		})
	}
}

// Each claim of a round carries its own job's deadline, however many
// jobs with deadlines one round claims.
func TestRoundClaimsKeepTheirOwnDeadlines(t *testing.T) {
	ctx := context.Background()
	tx, err := big.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx)                    //nolint:errcheck
	ids := []string{"j00000679", "j00001843"} // pending, with deadlines (see fill)
	_, err = tx.Exec(ctx, `UPDATE keel_jobs SET deadline = now() + (CASE id WHEN $1 THEN 1 ELSE 2 END) * interval '1 hour'
		WHERE id = ANY($2)`, ids[0], ids)
	require.NoError(t, err)
	got := map[string]*time.Time{}
	require.NoError(t, ledger.Round(ctx, tx, ledger.RoundArgs{Holder: "w", LeaseMS: 10000, Claim: ids, Done: []string{}, DoneRuns: []int32{}},
		func(c ledger.Claimed) { got[c.ID] = c.Deadline }))
	require.Len(t, got, 2)
	require.NotNil(t, got[ids[0]])
	require.NotNil(t, got[ids[1]])
	require.Equal(t, time.Hour, got[ids[1]].Sub(*got[ids[0]]).Round(time.Minute), "each claim's deadline is its own")
}
