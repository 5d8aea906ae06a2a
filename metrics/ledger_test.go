package metrics_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/jobstore"
	"github.com/keeljobs/keel/internal/testenv"
	"github.com/keeljobs/keel/metrics"
)

const schema = "keel_test_metrics"

func insertJob(t *testing.T, pool *pgxpool.Pool, queue, kind, key string) idempotency.Job {
	t.Helper()
	j, _, err := jobstore.NewStore(pool).Insert(context.Background(), pool, jobstore.NewJob{
		Kind: kind, BusinessKey: key, Queue: queue, Payload: []byte(`{}`), MaxRetry: 3})
	require.NoError(t, err)
	return j
}

func TestLedgerReadsDeadLettersAndOutbox(t *testing.T) {
	pool := testenv.Pool(t, schema)
	ctx := context.Background()

	// Two dead jobs of one kind and class, one of another class; one
	// committed job the relay has not published yet (backlog) and one on
	// its outbox (backlog, the oldest); one published job and two to run
	// later (not backlog).
	for i, class := range []string{"permanent", "permanent", "transient"} {
		j := insertJob(t, pool, "critical", "order:send_receipt", "order:"+string(rune('1'+i)))
		_, err := pool.Exec(ctx, `UPDATE keel_jobs SET status = 'dead', error_class = $2, finished_at = now(),
			published_at = now() WHERE id = $1`, j.ID, class)
		require.NoError(t, err)
	}
	insertJob(t, pool, "default", "analytics:sync", "day:1")
	_, err := pool.Exec(ctx, `UPDATE keel_jobs SET updated_at = now() - interval '90 seconds' WHERE kind = 'analytics:sync'`)
	require.NoError(t, err)
	published := insertJob(t, pool, "default", "analytics:sync", "day:2")
	_, err = pool.Exec(ctx, `UPDATE keel_jobs SET published_at = now() WHERE id = $1`, published.ID)
	require.NoError(t, err)
	_, _, err = jobstore.NewStore(pool).Insert(ctx, pool, jobstore.NewJob{Kind: "analytics:sync", BusinessKey: "day:3",
		Queue: "default", Payload: []byte(`{}`), MaxRetry: 3, WakeRelay: true})
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `UPDATE keel_outbox SET queued_at = now() - interval '2 minutes'`)
	require.NoError(t, err)
	// A job to run in an hour, an hour-old job handed back by a worker to
	// run in an hour: not the relay's yet, whatever their age.
	_, _, err = jobstore.NewStore(pool).Insert(ctx, pool, jobstore.NewJob{Kind: "analytics:sync", BusinessKey: "day:4",
		Queue: "default", Payload: []byte(`{}`), MaxRetry: 3, RunAt: time.Now().Add(time.Hour), WakeRelay: true})
	require.NoError(t, err)
	waits := insertJob(t, pool, "default", "analytics:sync", "day:5")
	_, err = pool.Exec(ctx, `UPDATE keel_jobs SET updated_at = now() - interval '1 hour', run_at = now() + interval '1 hour'
		WHERE id = $1`, waits.ID)
	require.NoError(t, err)

	l := newLedger(t, metrics.LedgerConfig{Pool: pool})
	s := l.Read(ctx)
	require.NoError(t, s.PostgresErr)
	require.Equal(t, []metrics.DeadCount{
		{Queue: "critical", Kind: "order:send_receipt", Class: "permanent", N: 2},
		{Queue: "critical", Kind: "order:send_receipt", Class: "transient", N: 1},
	}, s.Dead)
	require.Equal(t, 2, s.OutboxBacklog)
	require.InDelta(t, 120, s.OutboxLag.Seconds(), 5)

	reg := prometheus.NewRegistry()
	reg.MustRegister(l)
	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP keel_dead_letters Dead jobs in the ledger waiting for a person, by queue, kind and error class.
# TYPE keel_dead_letters gauge
keel_dead_letters{class="permanent",kind="order:send_receipt",queue="critical"} 2
keel_dead_letters{class="transient",kind="order:send_receipt",queue="critical"} 1
# HELP keel_outbox_backlog Committed jobs the relay has not yet handed to Redis.
# TYPE keel_outbox_backlog gauge
keel_outbox_backlog 2
# HELP keel_collector_up 1 when the last scrape could read the source (redis or postgres).
# TYPE keel_collector_up gauge
keel_collector_up{source="postgres"} 1
`), "keel_dead_letters", "keel_outbox_backlog", "keel_collector_up"))
}

func TestLedgerReportsAnUnreachableSource(t *testing.T) {
	pool := testenv.Pool(t, schema)
	// Nothing listens on port 1: the Redis half fails, the ledger half works.
	insp := asynq.NewInspector(asynq.RedisClientOpt{Addr: "127.0.0.1:1", DialTimeout: 200 * time.Millisecond})
	defer insp.Close()
	reg := prometheus.NewRegistry()
	reg.MustRegister(newLedger(t, metrics.LedgerConfig{Pool: pool, Inspector: insp, Timeout: 2 * time.Second}))
	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP keel_collector_up 1 when the last scrape could read the source (redis or postgres).
# TYPE keel_collector_up gauge
keel_collector_up{source="postgres"} 1
keel_collector_up{source="redis"} 0
`), "keel_collector_up", "keel_queue_size"))
}

func TestLedgerScrapeIsBoundedByItsTimeout(t *testing.T) {
	pool := testenv.Pool(t, schema)
	// A ledger query that cannot finish within the timeout: hold a lock the
	// dead-letter query needs.
	tx, err := pool.Begin(context.Background())
	require.NoError(t, err)
	defer tx.Rollback(context.Background()) //nolint:errcheck
	_, err = tx.Exec(context.Background(), `LOCK TABLE keel_jobs IN ACCESS EXCLUSIVE MODE`)
	require.NoError(t, err)

	l := newLedger(t, metrics.LedgerConfig{Pool: pool, Timeout: 300 * time.Millisecond})
	start := time.Now()
	reg := prometheus.NewRegistry()
	reg.MustRegister(l)
	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP keel_collector_up 1 when the last scrape could read the source (redis or postgres).
# TYPE keel_collector_up gauge
keel_collector_up{source="postgres"} 0
`), "keel_collector_up", "keel_dead_letters", "keel_outbox_backlog"))
	require.Less(t, time.Since(start), 3*time.Second)
}

func TestLedgerCountsOpenBatches(t *testing.T) {
	pool := testenv.Pool(t, schema)
	ctx := context.Background()
	store := jobstore.NewStore(pool)
	for range 2 {
		_, err := store.CreateBatch(ctx, pool, jobstore.NewBatch{Description: "filling"})
		require.NoError(t, err)
	}
	sealed, err := store.CreateBatch(ctx, pool, jobstore.NewBatch{})
	require.NoError(t, err)
	_, _, err = store.Insert(ctx, pool, jobstore.NewJob{Kind: "k", BusinessKey: "m", Queue: "default",
		Payload: []byte(`{}`), MaxRetry: 3, BatchID: sealed.ID})
	require.NoError(t, err)
	_, err = store.SealBatch(ctx, pool, sealed.ID)
	require.NoError(t, err)
	done, err := store.CreateBatch(ctx, pool, jobstore.NewBatch{})
	require.NoError(t, err)
	_, err = store.SealBatch(ctx, pool, done.ID) // empty: complete at once
	require.NoError(t, err)

	l := newLedger(t, metrics.LedgerConfig{Pool: pool})
	s := l.Read(ctx)
	require.NoError(t, s.PostgresErr)
	require.Equal(t, 2, s.BatchesOpen)
	require.Equal(t, 1, s.BatchesSealed)
	reg := prometheus.NewRegistry()
	reg.MustRegister(l)
	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP keel_batches_open Batches not complete: state open (members may join) or sealed (waiting for members to end).
# TYPE keel_batches_open gauge
keel_batches_open{state="open"} 2
keel_batches_open{state="sealed"} 1
`), "keel_batches_open"))
}

// Waiting jobs are counted by kind, those on a dead parent apart, with the
// age of the oldest.
func TestLedgerCountsWaitingJobs(t *testing.T) {
	pool, _ := testenv.PrivatePool(t)
	ctx := context.Background()
	store := jobstore.NewStore(pool)
	parent := insertJob(t, pool, "default", "export", "e1")
	doomed := insertJob(t, pool, "default", "export", "e2")
	for i, p := range []string{parent.ID, parent.ID, doomed.ID} {
		_, _, err := store.Insert(ctx, pool, jobstore.NewJob{Kind: "report", BusinessKey: fmt.Sprint("r", i), Queue: "default",
			Payload: []byte(`{}`), MaxRetry: 3, After: []jobstore.Ref{{ID: p}}})
		require.NoError(t, err)
	}
	// The second export died (as the guard records a death).
	_, err := pool.Exec(ctx, `UPDATE keel_jobs SET status = 'dead', finished_at = now() WHERE id = $1`, doomed.ID)
	require.NoError(t, err)

	l := newLedger(t, metrics.LedgerConfig{Pool: pool})
	s := l.Read(ctx)
	require.NoError(t, s.PostgresErr)
	require.Len(t, s.Waiting, 1)
	require.Equal(t, "report", s.Waiting[0].Kind)
	require.Equal(t, int64(3), s.Waiting[0].N)
	require.Equal(t, int64(1), s.Waiting[0].OnDead)
	reg := prometheus.NewRegistry()
	reg.MustRegister(l)
	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP keel_jobs_waiting Jobs waiting for their parents to succeed (tasks.After, workflows), by kind.
# TYPE keel_jobs_waiting gauge
keel_jobs_waiting{kind="report"} 3
# HELP keel_jobs_waiting_on_dead Waiting jobs with a dead parent: they wait for a person (replay the parent, or release or cancel the job).
# TYPE keel_jobs_waiting_on_dead gauge
keel_jobs_waiting_on_dead{kind="report"} 1
`), "keel_jobs_waiting", "keel_jobs_waiting_on_dead"))
}

// Jobs held for their concurrency key's slot are counted by kind, apart
// from those waiting for parents, with how many keys they wait on.
func TestLedgerCountsHeldJobs(t *testing.T) {
	pool, _ := testenv.PrivatePool(t)
	ctx := context.Background()
	store := jobstore.NewStore(pool)
	for i, tenant := range []string{"acme", "acme", "acme", "globex", "globex", "initech"} {
		_, _, err := store.Insert(ctx, pool, jobstore.NewJob{Kind: "invoice", BusinessKey: fmt.Sprint("i", i), Queue: "default",
			Payload: []byte(`{}`), MaxRetry: 3, ConcurrencyKey: tenant, ConcurrencyLimit: 1})
		require.NoError(t, err)
	}
	l := newLedger(t, metrics.LedgerConfig{Pool: pool})
	s := l.Read(ctx)
	require.NoError(t, s.PostgresErr)
	require.Empty(t, s.Waiting, "held jobs counted as waiting for parents")
	require.Len(t, s.Held, 1)
	reg := prometheus.NewRegistry()
	reg.MustRegister(l)
	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP keel_concurrency_held_jobs Jobs held for a slot of their concurrency key (tasks.ConcurrencyKey), by kind.
# TYPE keel_concurrency_held_jobs gauge
keel_concurrency_held_jobs{kind="invoice"} 3
# HELP keel_concurrency_held_keys Concurrency keys of a kind with a job held for a slot.
# TYPE keel_concurrency_held_keys gauge
keel_concurrency_held_keys{kind="invoice"} 2
`), "keel_concurrency_held_jobs", "keel_concurrency_held_keys"))
}
