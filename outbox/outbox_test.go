package outbox_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/jobstore"
	"github.com/keeljobs/keel/internal/testenv"
	"github.com/keeljobs/keel/internal/testworker"
	"github.com/keeljobs/keel/outbox"
	"github.com/keeljobs/keel/server"
	"github.com/keeljobs/keel/tasks"
)

func TestMain(m *testing.M) {
	if runChildWorker() {
		return
	}
	goleak.VerifyTestMain(m,
		goleak.IgnoreTopFunction("github.com/jackc/pgx/v5/pgxpool.(*Pool).backgroundHealthCheck"),
		goleak.IgnoreTopFunction("internal/poll.runtime_pollWait"),
	)
}

type item struct {
	ID string `json:"id"`
}

var work = tasks.Define[item]("outbox:work", tasks.Key(func(i item) string { return i.ID }))

type bundle struct {
	pool   *pgxpool.Pool
	schema string
	redis  *testenv.RedisServer
	opt    asynq.RedisClientOpt
}

// setup gives the test a ledger schema and a Redis of its own (these tests
// stop and flush it), and runs it in parallel with the package's others.
func setup(t *testing.T) *bundle {
	t.Helper()
	t.Parallel()
	return setupAlone(t)
}

// setupAlone is setup for a test that changes a package variable or whose
// margins are CPU time: it runs before the parallel ones, not beside them.
func setupAlone(t *testing.T) *bundle {
	t.Helper()
	rs := testenv.StartRedis(t)
	b := &bundle{redis: rs, opt: asynq.RedisClientOpt{Addr: rs.Addr()}}
	b.pool, b.schema = testenv.PrivatePool(t)
	_, err := b.pool.Exec(context.Background(), `CREATE TABLE effects (item text NOT NULL, job_id text NOT NULL)`)
	require.NoError(t, err)
	return b
}

func (b *bundle) client(t *testing.T, opt asynq.RedisConnOpt) *tasks.Client {
	c, err := tasks.NewClient(tasks.ClientConfig{Redis: opt, Pool: b.pool})
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	return c
}

// effectMux records each run's local effect in the same transaction as the
// job's completion.
func (b *bundle) effectMux(runs *atomic.Int64) *tasks.Mux {
	mux := tasks.NewMux()
	tasks.Handle(mux, work, func(ctx context.Context, it item) error {
		runs.Add(1)
		return idempotency.InTx(ctx, func(tx pgx.Tx) error {
			id, _ := idempotency.JobID(ctx)
			_, err := tx.Exec(ctx, `INSERT INTO effects (item, job_id) VALUES ($1, $2)`, it.ID, id)
			return err
		})
	})
	return mux
}

func (b *bundle) worker(t *testing.T, mux *tasks.Mux, mod func(*server.Config)) {
	t.Helper()
	cfg := server.Config{Redis: b.opt, Pool: b.pool, Concurrency: 20, ShutdownTimeout: 2 * time.Second,
		Relay:      outbox.RelayConfig{PollInterval: 200 * time.Millisecond},
		Reconciler: outbox.ReconcilerConfig{Interval: 500 * time.Millisecond, Grace: time.Second},
		Guard:      server.GuardConfig{LedgerRetry: time.Second}}
	cfg.Retry.Base, cfg.Retry.Cap = time.Second, 2*time.Second
	if mod != nil {
		mod(&cfg)
	}
	testworker.RunServer(t, cfg, mux)
}

func (b *bundle) count(t *testing.T, sql string, args ...any) int {
	t.Helper()
	var n int
	require.NoError(t, b.pool.QueryRow(context.Background(), sql, args...).Scan(&n))
	return n
}

// waitAllSucceeded waits until n jobs succeeded and checks each effect
// exists exactly once.
func (b *bundle) waitAllSucceeded(t *testing.T, n int, timeout time.Duration) {
	t.Helper()
	testenv.Eventually(t, timeout, func() bool {
		return b.count(t, `SELECT count(*) FROM keel_jobs WHERE status = 'succeeded'`) == n
	}, "not all %d jobs succeeded", n)
	require.Equal(t, n, b.count(t, `SELECT count(*) FROM effects`), "effects")
	require.Equal(t, n, b.count(t, `SELECT count(DISTINCT item) FROM effects`), "an effect happened twice")
}

func TestEnqueueTxCommitRunsOnceRollbackNever(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	c := b.client(t, b.opt)
	var runs atomic.Int64
	b.worker(t, b.effectMux(&runs), nil)

	require.NoError(t, pgx.BeginFunc(ctx, b.pool, func(tx pgx.Tx) error {
		_, err := c.EnqueueTx(ctx, tx, work.New(item{ID: "committed"}))
		return err
	}))
	_ = pgx.BeginFunc(ctx, b.pool, func(tx pgx.Tx) error {
		_, err := c.EnqueueTx(ctx, tx, work.New(item{ID: "rolled-back"}))
		require.NoError(t, err)
		return fmt.Errorf("roll back")
	})
	b.waitAllSucceeded(t, 1, 10*time.Second)
	testenv.WaitAsynqIdle(t, b.opt, 10*time.Second, "default")
	require.EqualValues(t, 1, runs.Load())
	require.Equal(t, 0, b.count(t, `SELECT count(*) FROM keel_jobs WHERE business_key = 'rolled-back'`))
}

// Redis really stopped while Enqueue runs: Enqueue still succeeds (the row
// is durable) and the relay publishes once Redis is back.
func TestRedisDownDuringEnqueue(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	c := b.client(t, b.opt)
	b.redis.Stop()
	res, err := c.Enqueue(ctx, work.New(item{ID: "while-down"}))
	require.NoError(t, err, "Enqueue must accept the job while Redis is down")
	require.False(t, res.Published)
	require.Nil(t, res.Job.PublishedAt)

	b.redis.Start()
	var runs atomic.Int64
	b.worker(t, b.effectMux(&runs), nil)
	b.waitAllSucceeded(t, 1, 15*time.Second)
	require.EqualValues(t, 1, runs.Load())
}

// Redis loses everything mid-run (restart without persistence): every
// accepted job still completes, each effect exactly once.
func TestRedisRestartedEmptyMidRun(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	c := b.client(t, b.opt)
	const n = 1000
	var wg sync.WaitGroup
	errs := make(chan error, n)
	sem := make(chan struct{}, 16)
	for i := range n {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			_, err := c.Enqueue(ctx, work.New(item{ID: fmt.Sprint("flush-", i)}))
			errs <- err
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	var runs atomic.Int64
	mux := tasks.NewMux()
	tasks.Handle(mux, work, func(ctx context.Context, it item) error {
		runs.Add(1)
		time.Sleep(5 * time.Millisecond) // keep the backlog long enough to lose part of it
		return idempotency.InTx(ctx, func(tx pgx.Tx) error {
			id, _ := idempotency.JobID(ctx)
			_, err := tx.Exec(ctx, `INSERT INTO effects (item, job_id) VALUES ($1, $2)`, it.ID, id)
			return err
		})
	})
	b.worker(t, mux, func(c *server.Config) { c.Concurrency = 5 })
	testenv.Eventually(t, 30*time.Second, func() bool {
		return b.count(t, `SELECT count(*) FROM keel_jobs WHERE status = 'succeeded'`) >= 100
	}, "processing never started")
	b.redis.Stop()
	b.redis.Start()
	lost := b.count(t, `SELECT count(*) FROM keel_jobs WHERE status <> 'succeeded'`)
	require.Greater(t, lost, 0, "the restart should have lost part of the backlog")
	b.waitAllSucceeded(t, n, 90*time.Second)
	require.LessOrEqual(t, runs.Load(), int64(n)+20, "runs beyond one per job are only the in-flight ones at the restart")
}

// A relay that crashed after publishing but before recording it: the next
// relay publishes again, and the job still runs once.
func TestRelayCrashBetweenPublishAndMark(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	store := jobstore.NewStore(b.pool)
	var jobs []idempotency.Job
	require.NoError(t, pgx.BeginFunc(ctx, b.pool, func(tx pgx.Tx) error {
		for i := range 20 {
			j, _, err := store.Insert(ctx, tx, jobstore.NewJob{Kind: work.Name(), BusinessKey: fmt.Sprint("crash-", i),
				Queue: "default", Payload: []byte(fmt.Sprintf(`{"id":"crash-%d"}`, i)), MaxRetry: 3})
			jobs = append(jobs, j)
			if err != nil {
				return err
			}
		}
		return nil
	}))
	ac := asynq.NewClient(b.opt)
	defer ac.Close()
	for _, j := range jobs[:10] {
		_, err := ac.EnqueueContext(ctx, jobstore.Task(j), jobstore.TaskOptions(j)...) // published, never marked
		require.NoError(t, err)
	}
	require.Equal(t, 20, b.count(t, `SELECT count(*) FROM keel_jobs WHERE published_at IS NULL`))

	var runs atomic.Int64
	b.worker(t, b.effectMux(&runs), nil)
	b.waitAllSucceeded(t, 20, 15*time.Second)
	testenv.WaitAsynqIdle(t, b.opt, 10*time.Second, "default")
	require.EqualValues(t, 20, runs.Load())
}

func TestTwoRelaysAndTwoReconcilersPublishEachJobOnce(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	store := jobstore.NewStore(b.pool)
	const n = 300
	require.NoError(t, pgx.BeginFunc(ctx, b.pool, func(tx pgx.Tx) error {
		for i := range n {
			if _, _, err := store.Insert(ctx, tx, jobstore.NewJob{Kind: work.Name(), BusinessKey: fmt.Sprint("pair-", i),
				Queue: "default", Payload: []byte(fmt.Sprintf(`{"id":"pair-%d"}`, i)), MaxRetry: 3}); err != nil {
				return err
			}
		}
		return nil
	}))
	var runs atomic.Int64
	mux := b.effectMux(&runs)
	b.worker(t, mux, nil)
	b.worker(t, mux, nil)
	// Two more stand-alone relays race the workers' own.
	rctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	for range 2 {
		r := newRelay(t, outbox.RelayConfig{Pool: b.pool, Redis: b.opt, PollInterval: 50 * time.Millisecond, BatchSize: 7})
		wg.Go(func() { _ = r.Run(rctx); _ = r.Close() })
	}
	b.waitAllSucceeded(t, n, 30*time.Second)
	cancel()
	wg.Wait()
	// Every job succeeded and the stand-alone relays stopped: once asynq
	// holds nothing more, no second run can come.
	testenv.WaitAsynqIdle(t, b.opt, 10*time.Second, "default")
	require.EqualValues(t, n, runs.Load())
}

func TestReconcilerRepublishesLostJobsOnly(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	c := b.client(t, b.opt)
	lost, err := c.Enqueue(ctx, work.New(item{ID: "lost"}, tasks.Delay(time.Hour)))
	require.NoError(t, err)
	kept, err := c.Enqueue(ctx, work.New(item{ID: "kept"}, tasks.Delay(time.Hour)))
	require.NoError(t, err)
	done, err := c.Enqueue(ctx, work.New(item{ID: "done"}, tasks.Delay(time.Hour)))
	require.NoError(t, err)
	_, err = b.pool.Exec(ctx, `UPDATE keel_jobs SET status = 'succeeded', finished_at = now() WHERE id = $1`, done.Job.ID)
	require.NoError(t, err)
	insp := asynq.NewInspector(b.opt)
	defer insp.Close()
	for _, id := range []string{lost.Job.ID, done.Job.ID} {
		require.NoError(t, insp.DeleteTask("default", id))
	}
	// An archived copy of a job the ledger says is still pending (its
	// failure was never recorded): drift, repaired like a lost one.
	archived, err := c.Enqueue(ctx, work.New(item{ID: "archived"}, tasks.Delay(time.Hour)))
	require.NoError(t, err)
	require.NoError(t, insp.ArchiveTask("default", archived.Job.ID))
	// Old enough to be past the grace period.
	_, err = b.pool.Exec(ctx, `UPDATE keel_jobs SET updated_at = now() - interval '1 hour', published_at = now() - interval '1 hour'`)
	require.NoError(t, err)

	r := newReconciler(t, outbox.ReconcilerConfig{Pool: b.pool, Redis: b.opt, Grace: time.Minute, BatchSize: 1})
	defer r.Close()
	n, err := r.Reconcile(ctx)
	require.NoError(t, err)
	require.Equal(t, 2, n, "only the lost and the wrongly archived job are republished")
	info, err := insp.GetTaskInfo("default", archived.Job.ID)
	require.NoError(t, err)
	require.Equal(t, asynq.TaskStateScheduled, info.State)
	info, err = insp.GetTaskInfo("default", lost.Job.ID)
	require.NoError(t, err)
	require.Equal(t, asynq.TaskStateScheduled, info.State, "a delayed job keeps its run time")
	_, err = insp.GetTaskInfo("default", done.Job.ID)
	require.ErrorIs(t, err, asynq.ErrTaskNotFound, "a succeeded job was resurrected")
	info, err = insp.GetTaskInfo("default", kept.Job.ID)
	require.NoError(t, err)
	require.Equal(t, asynq.TaskStateScheduled, info.State)
	n, err = r.Reconcile(ctx)
	require.NoError(t, err)
	require.Equal(t, 0, n, "a job Redis holds must not be published twice")
}

// A pass leaves a gone worker's row as it is: the guard counts the crash
// when it claims a running row whose lease expired, and a row moved back to
// pending would hide it. Handing the job back is Rescue's part.
func TestReconcilerLeavesAGoneWorkersRowForTheGuard(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	c := b.client(t, b.opt)
	res, err := c.Enqueue(ctx, work.New(item{ID: "orphan"}, tasks.Delay(time.Hour)))
	require.NoError(t, err)
	_, err = b.pool.Exec(ctx, `UPDATE keel_jobs SET status = 'running', attempts = 1, lease_holder = 'gone/1',
		lease_until = now() - interval '10 minutes', updated_at = now() - interval '1 hour' WHERE id = $1`, res.Job.ID)
	require.NoError(t, err)
	r := newReconciler(t, outbox.ReconcilerConfig{Pool: b.pool, Redis: b.opt, Grace: time.Minute})
	defer r.Close()
	n, err := r.Reconcile(ctx)
	require.NoError(t, err)
	require.Equal(t, 0, n, "Redis still holds the job")
	j, err := jobstore.NewStore(b.pool).Get(ctx, res.Job.ID)
	require.NoError(t, err)
	require.Equal(t, idempotency.StatusRunning, j.Status, "the crash must stay visible to the next claim")
	require.Equal(t, "gone/1", j.LeaseHolder)
}

func TestPruneRemovesOnlyExpiredTerminalRows(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	store := jobstore.NewStore(b.pool)
	mk := func(key, status string, age time.Duration) {
		j, _, err := store.Insert(ctx, b.pool, jobstore.NewJob{Kind: work.Name(), BusinessKey: key, Queue: "default",
			Payload: []byte(`{}`), MaxRetry: 1})
		require.NoError(t, err)
		_, err = b.pool.Exec(ctx, `UPDATE keel_jobs SET status = $2, finished_at = now() - $3 * interval '1 second' WHERE id = $1`,
			j.ID, status, age.Seconds())
		require.NoError(t, err)
		_, err = b.pool.Exec(ctx, `INSERT INTO keel_steps (job_id, name, status) VALUES ($1, 's', 'done')`, j.ID)
		require.NoError(t, err)
	}
	day := 24 * time.Hour
	for i := range 5 {
		mk(fmt.Sprint("old-ok-", i), "succeeded", 40*day)
	}
	mk("old-discarded", "discarded", 40*day)
	mk("old-cancelled", "cancelled", 40*day)
	mk("new-cancelled", "cancelled", day)
	mk("old-dead", "dead", 400*day)
	mk("new-ok", "succeeded", day)
	mk("old-running", "running", 40*day)
	mk("old-pending", "pending", 40*day)

	r := newReconciler(t, outbox.ReconcilerConfig{Pool: b.pool, Redis: b.opt, Retention: 30 * day, PruneBatch: 2})
	defer r.Close()
	n, err := r.Prune(ctx)
	require.NoError(t, err)
	require.Equal(t, 7, n)
	var left []string
	rows, err := b.pool.Query(ctx, `SELECT business_key FROM keel_jobs ORDER BY business_key`)
	require.NoError(t, err)
	left, err = pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	require.Equal(t, []string{"new-cancelled", "new-ok", "old-dead", "old-pending", "old-running"}, left)
	require.Equal(t, 5, b.count(t, `SELECT count(*) FROM keel_steps`), "steps of pruned jobs must go with them")
	require.Equal(t, 7, b.count(t, `SELECT coalesce(sum(rows), 0) FROM keel_prune_log`))
}

// A batch row goes with its members: once it completed longer than
// Retention ago and pruning has removed every member. A batch with a member
// left (a dead one a person may still replay) or still open stays.
func TestPruneRemovesBatchesWhoseMembersAreGone(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	day := 24 * time.Hour
	store := jobstore.NewStore(b.pool)
	mk := func(id string, members []string, completedAgo time.Duration) {
		_, err := b.pool.Exec(ctx, `INSERT INTO keel_batches (id, created_at) VALUES ($1, now() - interval '60 days')`, id)
		require.NoError(t, err)
		for i, st := range members {
			j, _, err := store.Insert(ctx, b.pool, jobstore.NewJob{Kind: work.Name(), BusinessKey: fmt.Sprint(id, "-", i), Queue: "default",
				Payload: []byte(`{}`), MaxRetry: 1, BatchID: id})
			require.NoError(t, err)
			_, err = b.pool.Exec(ctx, `UPDATE keel_jobs SET status = $2, finished_at = now() - interval '45 days' WHERE id = $1`, j.ID, st)
			require.NoError(t, err)
		}
		if completedAgo > 0 {
			_, err = b.pool.Exec(ctx, `UPDATE keel_batches SET sealed_at = created_at, completed_at = now() - $2 * interval '1 second' WHERE id = $1`,
				id, completedAgo.Seconds())
			require.NoError(t, err)
		}
	}
	mk("b-old-done", []string{"succeeded", "succeeded"}, 40*day)
	mk("b-old-empty", nil, 40*day)
	mk("b-old-dead", []string{"succeeded", "dead"}, 40*day)
	mk("b-new-done", []string{"succeeded"}, day)
	mk("b-old-open", []string{"succeeded"}, 0)

	r := newReconciler(t, outbox.ReconcilerConfig{Pool: b.pool, Redis: b.opt, Retention: 30 * day, PruneBatch: 1})
	defer r.Close()
	n, err := r.Prune(ctx)
	require.NoError(t, err)
	require.Equal(t, 5, n, "the succeeded members past retention")
	rows, err := b.pool.Query(ctx, `SELECT id FROM keel_batches ORDER BY id`)
	require.NoError(t, err)
	left, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	require.Equal(t, []string{"b-new-done", "b-old-dead", "b-old-open"}, left)
	require.Equal(t, uint64(2), r.Stats().PrunedBatches)
}

// Jobs pruned are counted and logged even when pruning batches then fails.
func TestPruneCountsJobsWhenBatchPruneFails(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	store := jobstore.NewStore(b.pool)
	for i := range 3 {
		j, _, err := store.Insert(ctx, b.pool, jobstore.NewJob{Kind: work.Name(), BusinessKey: fmt.Sprint("gone-", i), Queue: "default",
			Payload: []byte(`{}`), MaxRetry: 1})
		require.NoError(t, err)
		_, err = b.pool.Exec(ctx, `UPDATE keel_jobs SET status = 'succeeded', finished_at = now() - interval '45 days' WHERE id = $1`, j.ID)
		require.NoError(t, err)
	}
	_, err := b.pool.Exec(ctx, `ALTER TABLE keel_batches RENAME TO keel_batches_away`)
	require.NoError(t, err)
	t.Cleanup(func() { b.pool.Exec(context.Background(), `ALTER TABLE keel_batches_away RENAME TO keel_batches`) }) //nolint:errcheck

	r := newReconciler(t, outbox.ReconcilerConfig{Pool: b.pool, Redis: b.opt, Retention: 30 * 24 * time.Hour})
	defer r.Close()
	n, err := r.Prune(ctx)
	require.Error(t, err)
	require.Equal(t, 3, n)
	require.Equal(t, uint64(3), r.Stats().Pruned)
	require.Equal(t, 3, b.count(t, `SELECT coalesce(sum(rows), 0) FROM keel_prune_log`))
}

// A relay pass while Redis is down hands every claimed row back, so the
// next pass (or another relay) publishes it; nothing waits for the reconciler.
func TestRelayHandsBackWhatRedisRefused(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	c := b.client(t, b.opt)
	require.NoError(t, pgx.BeginFunc(ctx, b.pool, func(tx pgx.Tx) error {
		for i := range 5 {
			if _, err := c.EnqueueTx(ctx, tx, work.New(item{ID: fmt.Sprint("back-", i)})); err != nil {
				return err
			}
		}
		return nil
	}))
	r := newRelay(t, outbox.RelayConfig{Pool: b.pool, Redis: b.opt})
	defer r.Close()
	b.redis.Stop()
	n, err := r.PublishBatch(ctx)
	require.Error(t, err)
	require.Equal(t, 0, n)
	require.Equal(t, 5, b.count(t, `SELECT count(*) FROM keel_jobs WHERE published_at IS NULL`), "claimed rows were not handed back")

	b.redis.Start()
	n, err = r.PublishBatch(ctx)
	require.NoError(t, err)
	require.Equal(t, 5, n)
	require.Equal(t, 0, b.count(t, `SELECT count(*) FROM keel_jobs WHERE published_at IS NULL`))
	insp := asynq.NewInspector(b.opt)
	defer insp.Close()
	info, err := insp.GetQueueInfo("default")
	require.NoError(t, err)
	require.Equal(t, 5, info.Pending)
}

// The relay is woken by the notification EnqueueTx sends at commit, not by
// its poll: with an hour-long poll the job still reaches Redis at once.
func TestEnqueueTxWakesTheRelay(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	c := b.client(t, b.opt)
	r := newRelay(t, outbox.RelayConfig{Pool: b.pool, Redis: b.opt, PollInterval: time.Hour})
	signals := runRelay(t, r)

	var id string
	require.NoError(t, pgx.BeginFunc(ctx, b.pool, func(tx pgx.Tx) error {
		// Several jobs in one transaction: one wake-up is enough.
		for i := range 3 {
			res, err := c.EnqueueTx(ctx, tx, work.New(item{ID: fmt.Sprint("wake-", i)}))
			if err != nil {
				return err
			}
			id = res.Job.ID
		}
		return nil
	}))
	insp := asynq.NewInspector(b.opt)
	defer insp.Close()
	require.Equal(t, 3, waitPublished(t, signals).Published, "the commit's jobs were not published in one look")
	require.True(t, inRedis(t, insp, id), "the relay was not woken by the commit")
	require.EqualValues(t, 3, r.Published())
}

// After Redis lost everything, republished jobs must sit in queues asynq
// lists again, or asynqmon, the inspector and the metrics cannot see them.
func TestReconcilerListsQueuesAgainAfterRedisLostThem(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	c := b.client(t, b.opt)
	r := newReconciler(t, outbox.ReconcilerConfig{Pool: b.pool, Redis: b.opt, Grace: time.Minute})
	defer r.Close()
	old := func() {
		_, err := b.pool.Exec(ctx, `UPDATE keel_jobs SET updated_at = now() - interval '1 hour', published_at = now() - interval '1 hour'`)
		require.NoError(t, err)
	}
	// A first repair makes the reconciler's own asynq client publish once,
	// after which asynq never lists the queue again on its own.
	first, err := c.Enqueue(ctx, work.New(item{ID: "first"}, tasks.Delay(time.Hour)))
	require.NoError(t, err)
	insp := asynq.NewInspector(b.opt)
	defer insp.Close()
	require.NoError(t, insp.DeleteTask("default", first.Job.ID))
	old()
	n, err := r.Reconcile(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, n)

	b.redis.Stop()
	b.redis.Start()
	old()
	n, err = r.Reconcile(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	queues, err := insp.Queues()
	require.NoError(t, err)
	require.Contains(t, queues, "default")
	info, err := insp.GetTaskInfo("default", first.Job.ID)
	require.NoError(t, err)
	require.Equal(t, asynq.TaskStateScheduled, info.State)
	n, err = r.Reconcile(ctx)
	require.NoError(t, err)
	require.Equal(t, 0, n, "a job Redis holds again is not repaired twice")
}

// One row Redis refuses (asynq will not take a blank task type) must not
// keep the relay from publishing the rest.
func TestRelayIsNotBlockedByOneBadJob(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	c := b.client(t, b.opt)
	_, err := b.pool.Exec(ctx, `INSERT INTO keel_jobs (id, kind, business_key, queue, payload, max_retry, run_at)
		VALUES ('poison', ' ', 'k', 'default', '\x7b7d', 3, now() - interval '1 hour')`)
	require.NoError(t, err)
	require.NoError(t, pgx.BeginFunc(ctx, b.pool, func(tx pgx.Tx) error {
		for i := range 40 {
			if _, err := c.EnqueueTx(ctx, tx, work.New(item{ID: fmt.Sprint("after-poison-", i)})); err != nil {
				return err
			}
		}
		return nil
	}))
	r := newRelay(t, outbox.RelayConfig{Pool: b.pool, Redis: b.opt})
	defer r.Close()
	n, err := r.PublishBatch(ctx)
	require.NoError(t, err)
	require.Equal(t, 40, n)
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM keel_jobs WHERE published_at IS NULL`), "only the bad row waits")
}
