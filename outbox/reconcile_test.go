package outbox_test

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/jobstore"
	"github.com/keeljobs/keel/internal/testenv"
	"github.com/keeljobs/keel/internal/testworker"
	"github.com/keeljobs/keel/outbox"
	"github.com/keeljobs/keel/server"
	"github.com/keeljobs/keel/tasks"
)

// countingOpt connects to the real Redis and counts round trips: each
// single command and each pipeline is one.
type countingOpt struct {
	asynq.RedisClientOpt
	trips *atomic.Int64
}

func (o countingOpt) MakeRedisClient() any {
	c := o.RedisClientOpt.MakeRedisClient().(*redis.Client)
	c.AddHook(tripHook{o.trips})
	return c
}

type tripHook struct{ n *atomic.Int64 }

func (h tripHook) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h tripHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error { h.n.Add(1); return next(ctx, cmd) }
}

func (h tripHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error { h.n.Add(1); return next(ctx, cmds) }
}

// A pass finds the few jobs Redis lost among thousands it holds with a
// Redis round trip per page, not per job.
func TestReconcilePassFindsLostJobsAmongManyWithFewRoundTrips(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	const n, batch = 3000, 500
	_, err := b.pool.Exec(ctx, `INSERT INTO keel_jobs (id, kind, business_key, queue, payload, max_retry, status, published_at, updated_at)
		SELECT 'j' || lpad(g::text, 5, '0'), $1, 'key' || g, 'default', convert_to('{"id":"' || g || '"}', 'UTF8'), 3,
		       (ARRAY['pending', 'failed'])[1 + g % 2]::text, now() - interval '1 hour', now() - interval '1 hour'
		FROM generate_series(1, $2::int) g`, work.Name(), n)
	require.NoError(t, err)
	store := jobstore.NewStore(b.pool)
	ac := asynq.NewClient(b.opt)
	defer ac.Close()
	var ids []string
	for i := 1; i <= n; i++ {
		ids = append(ids, fmt.Sprintf("j%05d", i))
	}
	all, err := store.GetMany(ctx, b.pool, ids)
	require.NoError(t, err)
	for _, j := range all {
		j.RunAt = time.Now().Add(time.Hour) // kept in Redis, not run
		_, err := ac.EnqueueContext(ctx, jobstore.Task(j), jobstore.TaskOptions(j)...)
		require.NoError(t, err)
	}
	insp := asynq.NewInspector(b.opt)
	defer insp.Close()
	lost := []string{"j00007", "j01234", "j01500", "j02999", "j03000"}
	for _, id := range lost {
		require.NoError(t, insp.DeleteTask("default", id))
	}
	require.NoError(t, insp.ArchiveTask("default", "j00100"))

	var trips atomic.Int64
	r := newReconciler(t, outbox.ReconcilerConfig{Pool: b.pool, Redis: countingOpt{b.opt, &trips}, BatchSize: batch})
	defer r.Close()
	trips.Store(0)
	got, err := r.Reconcile(ctx)
	require.NoError(t, err)
	require.Equal(t, len(lost)+1, got)
	t.Logf("%d open jobs, %d lost: %d Redis round trips", n, len(lost)+1, trips.Load())
	// A pipeline per page, and a few commands per job published again.
	require.Less(t, trips.Load(), int64(n/batch+1+4*(len(lost)+1)), "Redis round trips per open job")
	for _, id := range append(lost, "j00100") {
		info, err := insp.GetTaskInfo("default", id)
		require.NoError(t, err, id)
		require.Contains(t, []asynq.TaskState{asynq.TaskStatePending, asynq.TaskStateScheduled}, info.State, id)
	}
	q, err := insp.GetQueueInfo("default")
	require.NoError(t, err)
	require.Equal(t, n, q.Size)
	got, err = r.Reconcile(ctx)
	require.NoError(t, err)
	require.Zero(t, got)
}

// keel's default settings bring back every job a flushed Redis lost within
// 30 seconds, each run once.
func TestDefaultsHealAFlushedRedisWithin30s(t *testing.T) {
	b := setupAlone(t)
	ctx := context.Background()
	c := b.client(t, b.opt)
	const n = 2000
	var wg sync.WaitGroup
	sem := make(chan struct{}, 16)
	for i := range n {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			_, err := c.Enqueue(ctx, work.New(item{ID: fmt.Sprint("healed-", i)}))
			require.NoError(t, err)
		})
	}
	wg.Wait()
	require.Equal(t, n, b.count(t, `SELECT count(*) FROM keel_jobs WHERE published_at IS NOT NULL`))
	b.redis.Stop()
	b.redis.Start()
	lostAt := time.Now()

	var runs atomic.Int64
	testworker.RunServer(t, server.Config{Redis: b.opt, Pool: b.pool}, b.effectMux(&runs))
	testenv.Eventually(t, 60*time.Second, func() bool {
		return b.count(t, `SELECT count(*) FROM keel_jobs WHERE status = 'succeeded'`) == n
	}, "the jobs Redis lost never all ran")
	took := time.Since(lostAt)
	t.Logf("%d jobs lost by Redis, all run %.1fs later", n, took.Seconds())
	require.Less(t, took, 30*time.Second)
	require.Equal(t, n, b.count(t, `SELECT count(DISTINCT item) FROM effects`))
	require.Equal(t, n, b.count(t, `SELECT count(*) FROM effects`))
}

// A cancelled job is closed: neither the reconciler nor the relay publishes
// it again, whatever Redis holds.
func TestCancelledJobsAreNotPublishedAgain(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	_, err := b.pool.Exec(ctx, `INSERT INTO keel_jobs (id, kind, business_key, queue, payload, max_retry, status, published_at, updated_at)
		VALUES ('was-published', $1, 'k1', 'default', '\x7b7d', 3, 'pending', now() - interval '1 hour', now() - interval '1 hour'),
		       ('never-published', $1, 'k2', 'default', '\x7b7d', 3, 'pending', NULL, now() - interval '1 hour')`, work.Name())
	require.NoError(t, err)
	store := jobstore.NewStore(b.pool)
	for _, id := range []string{"was-published", "never-published"} {
		_, err := testworker.Ops(t, store, nil).Cancel(ctx, id, "test", "")
		require.NoError(t, err)
	}
	r := newReconciler(t, outbox.ReconcilerConfig{Pool: b.pool, Redis: b.opt})
	defer r.Close()
	got, err := r.Reconcile(ctx)
	require.NoError(t, err)
	require.Zero(t, got, "the reconciler published a cancelled job")
	relay := newRelay(t, outbox.RelayConfig{Pool: b.pool, Redis: b.opt})
	defer relay.Close()
	n, err := relay.PublishBatch(ctx)
	require.NoError(t, err)
	require.Zero(t, n, "the relay published a cancelled job")
	insp := asynq.NewInspector(b.opt)
	defer insp.Close()
	queues, err := insp.Queues()
	require.NoError(t, err)
	if slices.Contains(queues, "default") {
		q, err := insp.GetQueueInfo("default")
		require.NoError(t, err)
		require.Zero(t, q.Size, "Redis holds a cancelled job")
	}
	for _, id := range []string{"was-published", "never-published"} {
		j, err := store.Get(ctx, id)
		require.NoError(t, err)
		require.Equal(t, idempotency.StatusCancelled, j.Status)
	}
}

// Run rescues and reconciles on schedules of their own, each at once when
// it starts: a dead worker's job is handed back by a rescue; a job Redis
// lost and one no relay took off the outbox are published by a pass, which
// prunes an expired job too; and the next pass finds nothing more to do.
func TestReconcilerRunRescuesRepairsAndPrunes(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	c := b.client(t, b.opt)
	insp := asynq.NewInspector(b.opt)
	defer insp.Close()
	orphan, err := c.Enqueue(ctx, work.New(item{ID: "orphan"}))
	require.NoError(t, err)
	b.fetchAsDeadWorker(t, 20*time.Second)
	b.orphan(t, orphan.Job.ID)
	lost, err := c.Enqueue(ctx, work.New(item{ID: "lost"}, tasks.Delay(time.Hour)))
	require.NoError(t, err)
	require.NoError(t, insp.DeleteTask("default", lost.Job.ID))
	_, err = b.pool.Exec(ctx, `UPDATE keel_jobs SET updated_at = now() - interval '1 hour' WHERE id = $1`, lost.Job.ID)
	require.NoError(t, err)
	noRelay := enqueueTx(t, c, b, "no-relay", nil)
	_, err = b.pool.Exec(ctx, `UPDATE keel_outbox SET queued_at = now() - interval '2 minutes' WHERE job_id = $1`, noRelay)
	require.NoError(t, err)
	old, err := c.Enqueue(ctx, work.New(item{ID: "old"}, tasks.Delay(time.Hour)))
	require.NoError(t, err)
	_, err = b.pool.Exec(ctx, `UPDATE keel_jobs SET status = 'succeeded', finished_at = now() - interval '45 days' WHERE id = $1`, old.Job.ID)
	require.NoError(t, err)

	// Grace keeps the orphan, updated a moment ago, out of the pass: only
	// the rescue hands it back. The second pass comes when the test asks.
	r := newReconciler(t, outbox.ReconcilerConfig{Pool: b.pool, Redis: b.opt, Grace: time.Minute,
		Interval: time.Hour, RescueInterval: time.Hour, PruneInterval: time.Hour})
	defer r.Close()
	signals := outbox.InitReconcileSignals(r)
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); _ = r.Run(runCtx) }()
	defer func() { cancel(); <-done }()

	rescue := signals.Rescued.Wait(t)
	require.NoError(t, rescue.Err)
	require.Equal(t, 1, rescue.Rescued)
	require.Equal(t, asynq.TaskStatePending, b.state(t, insp, orphan.Job.ID))
	pass := signals.Passed.Wait(t)
	require.NoError(t, pass.Err)
	require.Equal(t, 2, pass.Published)
	require.EqualValues(t, 1, pass.Republished, "the job no relay took was not lost")
	require.EqualValues(t, 1, pass.TakenOver, "the job no relay took")
	require.EqualValues(t, 1, pass.Pruned)
	require.Equal(t, asynq.TaskStateScheduled, b.state(t, insp, lost.Job.ID))
	require.Equal(t, asynq.TaskStatePending, b.state(t, insp, noRelay))
	require.Zero(t, b.count(t, `SELECT count(*) FROM keel_jobs WHERE id = $1`, old.Job.ID))

	n, err := r.Reconcile(ctx)
	require.NoError(t, err)
	require.Zero(t, n, "a job published again by the pass was published twice")
	require.Equal(t, outbox.ReconcileStats{Republished: 1, TakenOver: 1, Rescued: 1, LeasesReleased: 1, Pruned: 1}, r.Stats())
	signals.Passed.RequireEmpty(t)
	signals.Rescued.RequireEmpty(t)
}
