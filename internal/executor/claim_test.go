package executor_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/internal/jobstore"
)

// ledgerRowsRead is how many keel_jobs rows and index entries the
// connection of one (a single-connection pool) has read so far.
func ledgerRowsRead(t *testing.T, one *pgxpool.Pool) int64 {
	t.Helper()
	ctx := context.Background()
	// Statistics reach the shared counters when a backend goes idle, at
	// most once a second unless forced: force this backend's, then read
	// them from a fresh snapshot.
	_, err := one.Exec(ctx, `SELECT pg_stat_force_next_flush()`)
	require.NoError(t, err)
	var n int64
	require.NoError(t, one.QueryRow(ctx, `SELECT
		(SELECT coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0) FROM pg_stat_user_tables
			WHERE schemaname = current_schema() AND relname = 'keel_jobs')
		+ (SELECT coalesce(sum(idx_tup_read), 0) FROM pg_stat_user_indexes
			WHERE schemaname = current_schema() AND relname = 'keel_jobs')`).Scan(&n))
	return n
}

// A relay's claims read the rows they claim, however many other jobs are
// open, even on a connection that first ran them while the ledger was
// empty. A prepared statement's plan is made once, after a few runs, from
// the table as it was then: the claim of unpublished rows settled on a
// bitmap scan of every open job (29 ms a poll with 120,000 jobs pending in
// Redis, every 2 ms while the relay was awake).
func TestClaimsReadWhatTheyClaimHoweverManyJobsAreOpen(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	var version int
	require.NoError(t, b.pool.QueryRow(ctx, `SELECT current_setting('server_version_num')::int`).Scan(&version))
	if version < 150000 {
		t.Skip("counting a backend's reads needs pg_stat_force_next_flush (Postgres 15)")
	}
	cfg := b.pool.Config()
	cfg.MaxConns = 1
	one, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	defer one.Close()
	store := jobstore.NewStore(one)

	// On an empty ledger, more runs than Postgres takes to settle on a plan
	// (each outbox claim with a row to take, whose job is long gone).
	for i := range 10 {
		_, err := one.Exec(ctx, `INSERT INTO keel_outbox (job_id) VALUES ($1)`, fmt.Sprint("gone-", i))
		require.NoError(t, err)
		_, taken, err := store.ClaimOutbox(ctx, 200)
		require.NoError(t, err)
		require.Equal(t, 1, taken)
		_, err = store.ClaimUnpublished(ctx, 200)
		require.NoError(t, err)
	}
	// 5,000 jobs waiting in Redis, then one job on the outbox and one
	// written unpublished.
	_, err = one.Exec(ctx, `INSERT INTO keel_jobs (id, kind, business_key, queue, payload, max_retry, published_at)
		SELECT 'open-' || g, 'test:open', 'key-' || g, 'default', '\x7b7d', 3, now() FROM generate_series(1, 5000) g`)
	require.NoError(t, err)
	outboxed, _, err := store.Insert(ctx, one, jobstore.NewJob{Kind: "test:claim", BusinessKey: "outbox",
		Queue: "default", Payload: []byte(`{}`), MaxRetry: 3, WakeRelay: true})
	require.NoError(t, err)
	unpublished, _, err := store.Insert(ctx, one, jobstore.NewJob{Kind: "test:claim", BusinessKey: "unpublished",
		Queue: "default", Payload: []byte(`{}`), MaxRetry: 3})
	require.NoError(t, err)

	before := ledgerRowsRead(t, one)
	jobs, taken, err := store.ClaimOutbox(ctx, 200)
	require.NoError(t, err)
	require.Equal(t, 1, taken)
	require.Len(t, jobs, 1)
	require.Equal(t, outboxed.ID, jobs[0].ID)
	jobs, err = store.ClaimUnpublished(ctx, 200)
	require.NoError(t, err)
	require.Len(t, jobs, 1)
	require.Equal(t, unpublished.ID, jobs[0].ID)
	read := ledgerRowsRead(t, one) - before
	require.Less(t, read, int64(50), "claiming 2 jobs read %d ledger rows and index entries", read)
}
