package ledger_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/internal/ledger"
)

// Progress and results are read and written by job id (or kind and key):
// each statement probes primary keys, never a whole table.
func TestProgressAndResultPlans(t *testing.T) {
	ctx := context.Background()
	id := "j00000008" // running, held by worker-0 (see fill)
	for name, call := range map[string]func(db ledger.DB){
		"write progress": func(db ledger.DB) { ledger.WriteProgress(ctx, db, id, "worker-0", 1, 1, 2, "n") }, //nolint:errcheck
		"complete with result": func(db ledger.DB) {
			ledger.CompleteWithResult(ctx, db, id, "worker-0", 1, []byte(`{}`)) //nolint:errcheck
		},
		"store result in InTx": func(db ledger.DB) {
			ledger.MarkSucceededAndCommit(ctx, db.(ledger.Batcher), id, "worker-0", 1, []byte(`{}`)) //nolint:errcheck
		},
	} {
		t.Run(name, func(t *testing.T) {
			lacks(t, plan(t, call), "Seq Scan")
		})
	}
	p := plan(t, func(db ledger.DB) { ledger.ReadProgress(ctx, db, id) }) //nolint:errcheck
	usesIndex(t, p, []string{"keel_job_progress_pkey"}, "keel_job_progress")
	p = plan(t, func(db ledger.DB) { ledger.ReadResult(ctx, db, id) }) //nolint:errcheck
	usesIndex(t, p, []string{"keel_jobs_pkey", "keel_job_results_pkey"}, "keel_jobs", "keel_job_results")
	p = plan(t, func(db ledger.DB) { ledger.ReadResultByKey(ctx, db, "kind1", "key8") }) //nolint:errcheck
	usesIndex(t, p, []string{"keel_job_results_pkey"}, "keel_jobs", "keel_job_results")
	// The prune takes a job's progress and result with it, by primary key.
	p = plan(t, func(db ledger.DB) { ledger.PruneKind(ctx, db, "kind1", "succeeded", 30*24*time.Hour, 1000, nil) }) //nolint:errcheck
	usesIndex(t, p, []string{"keel_job_progress_pkey", "keel_job_results_pkey"}, "keel_job_progress", "keel_job_results")
}

// A report is written only by the run that holds the job while it runs,
// and an older run's report never replaces a newer one's.
func TestProgressOnlyFromTheRunningRun(t *testing.T) {
	ctx := context.Background()
	tx, err := big.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck
	_, err = tx.Exec(ctx, `INSERT INTO keel_jobs (id, kind, business_key, queue, payload, max_retry, status, published_at,
		lease_holder, lease_until, run) VALUES ('zp', 'k', 'zp', 'default', '\x7b7d', 3, 'running', now(), 'w', now() + interval '1 hour', 2)`)
	require.NoError(t, err)

	_, err = ledger.ReadProgress(ctx, tx, "zp")
	require.True(t, errors.Is(err, pgx.ErrNoRows), "no report yet: %v", err)
	for _, c := range []struct {
		holder string
		run    int
	}{{"other", 2}, {"w", 1}, {"w", 3}} {
		ok, err := ledger.WriteProgress(ctx, tx, "zp", c.holder, c.run, 1, 10, "x")
		require.NoError(t, err)
		require.False(t, ok, "holder %s run %d does not hold the job", c.holder, c.run)
	}
	ok, err := ledger.WriteProgress(ctx, tx, "zp", "w", 2, 3, 10, "copying")
	require.NoError(t, err)
	require.True(t, ok)
	ok, err = ledger.WriteProgress(ctx, tx, "zp", "w", 2, 4, 10, "still copying")
	require.NoError(t, err)
	require.True(t, ok, "the run's next report replaces its last")
	p, err := ledger.ReadProgress(ctx, tx, "zp")
	require.NoError(t, err)
	require.Equal(t, ledger.JobProgress{Run: 2, Done: 4, Total: 10, Note: "still copying", UpdatedAt: p.UpdatedAt}, p)

	// A later run's report stands against an older run's that lands late.
	_, err = tx.Exec(ctx, `UPDATE keel_job_progress SET run = 5 WHERE job_id = 'zp'`)
	require.NoError(t, err)
	ok, err = ledger.WriteProgress(ctx, tx, "zp", "w", 2, 9, 10, "late")
	require.NoError(t, err)
	require.False(t, ok)

	// Once the run's outcome is recorded, its reports are refused.
	_, err = tx.Exec(ctx, `UPDATE keel_job_progress SET run = 2 WHERE job_id = 'zp'`)
	require.NoError(t, err)
	_, _, err = ledger.Fail(ctx, tx, ledger.Failure{ID: "zp", Holder: "w", Run: 2, Status: ledger.StatusFailed, RunInMS: 1000})
	require.NoError(t, err)
	ok, err = ledger.WriteProgress(ctx, tx, "zp", "w", 2, 10, 10, "after the end")
	require.NoError(t, err)
	require.False(t, ok, "a run given up writes nothing")
	p, err = ledger.ReadProgress(ctx, tx, "zp")
	require.NoError(t, err)
	require.Equal(t, int64(4), p.Done, "the failed run's last report stays")
}

// A result without a completing InTx commits in the completion's
// statement, only for the run that holds the job; it is read with a
// succeeded job only, by id or by key, and the prune takes it.
func TestResultGoesWithSuccess(t *testing.T) {
	ctx := context.Background()
	tx, err := big.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck
	_, err = tx.Exec(ctx, `INSERT INTO keel_jobs (id, kind, business_key, queue, payload, max_retry, status, published_at,
		lease_holder, lease_until, run) VALUES ('zr', 'k', 'zr', 'default', '\x7b7d', 3, 'running', now(), 'w', now() + interval '1 hour', 1)`)
	require.NoError(t, err)

	err = ledger.CompleteWithResult(ctx, tx, "zr", "w", 2, []byte(`{"n": 1}`))
	require.True(t, errors.Is(err, pgx.ErrNoRows), "another run's completion: %v", err)
	r, err := ledger.ReadResult(ctx, tx, "zr")
	require.NoError(t, err)
	require.Equal(t, ledger.JobResult{JobID: "zr", Status: ledger.StatusRunning}, r, "no result, no success")

	require.NoError(t, ledger.CompleteWithResult(ctx, tx, "zr", "w", 1, []byte(`{"n": 1, "s": "\u0000"}`)))
	r, err = ledger.ReadResult(ctx, tx, "zr")
	require.NoError(t, err)
	require.Equal(t, ledger.StatusSucceeded, r.Status)
	require.JSONEq(t, `{"n": 1, "s": "\u0000"}`, string(r.JSON))
	require.False(t, r.StoredAt.IsZero())
	byKey, err := ledger.ReadResultByKey(ctx, tx, "k", "zr")
	require.NoError(t, err)
	require.Equal(t, r, byKey)
	_, err = ledger.ReadResult(ctx, tx, "nope")
	require.True(t, errors.Is(err, pgx.ErrNoRows))

	// A handler that failed after its completing InTx: dead, no result.
	_, _, err = ledger.DeadAfterComplete(ctx, tx, "zr", "boom", "")
	require.NoError(t, err)
	var n int
	require.NoError(t, tx.QueryRow(ctx, `SELECT count(*) FROM keel_job_results WHERE job_id = 'zr'`).Scan(&n))
	require.Zero(t, n)

	// The prune takes a job's progress and result with it.
	_, err = tx.Exec(ctx, `UPDATE keel_jobs SET status = 'succeeded' WHERE id = 'zr';
		INSERT INTO keel_job_results (job_id, result) VALUES ('zr', '1');
		INSERT INTO keel_job_progress (job_id, run, done, total) VALUES ('zr', 1, 1, 1)`)
	require.NoError(t, err)
	require.Positive(t, pruneAll(t, tx, 100*24*time.Hour, ledger.At(time.Now().Add(365*24*time.Hour))))
	require.NoError(t, tx.QueryRow(ctx, `SELECT count(*) FROM keel_job_progress p WHERE NOT EXISTS (SELECT FROM keel_jobs j WHERE j.id = p.job_id)`).Scan(&n))
	require.Zero(t, n, "no progress is left without its job")
	require.NoError(t, tx.QueryRow(ctx, `SELECT count(*) FROM keel_job_results r WHERE NOT EXISTS (SELECT FROM keel_jobs j WHERE j.id = r.job_id)`).Scan(&n))
	require.Zero(t, n, "no result is left without its job")
}
