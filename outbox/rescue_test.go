package outbox_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
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

// fetchAsDeadWorker makes the next task of queue default active, as a
// worker that fetched it (or last extended its asynq lease) ago and then
// died would have left it.
func (b *bundle) fetchAsDeadWorker(t *testing.T, ago time.Duration) {
	t.Helper()
	rdb := redis.NewClient(&redis.Options{Addr: b.opt.Addr})
	defer rdb.Close()
	require.NoError(t, testworker.AsynqFetch(context.Background(), rdb, "default", time.Now().Add(30*time.Second-ago)))
}

// orphan marks jobs as held by a worker whose ledger lease ran out.
func (b *bundle) orphan(t *testing.T, ids ...string) {
	t.Helper()
	_, err := b.pool.Exec(context.Background(), `UPDATE keel_jobs SET status = 'running', attempts = attempts + 1,
		lease_holder = 'gone/1', lease_until = now() - interval '1 second' WHERE id = ANY($1)`, ids)
	require.NoError(t, err)
}

func (b *bundle) state(t *testing.T, insp *asynq.Inspector, id string) asynq.TaskState {
	t.Helper()
	info, err := insp.GetTaskInfo("default", id)
	require.NoError(t, err)
	return info.State
}

func (b *bundle) reconciler(t *testing.T) *outbox.Reconciler {
	r := newReconciler(t, outbox.ReconcilerConfig{Pool: b.pool, Redis: b.opt})
	t.Cleanup(func() { r.Close() })
	return r
}

// A dead worker's active task goes back to its queue at once and a worker
// runs it; a task fetched a moment ago, which may not be in its server's
// worker list yet, is left alone.
func TestRescueRequeuesADeadWorkersActiveTask(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	c := b.client(t, b.opt)
	insp := asynq.NewInspector(b.opt)
	defer insp.Close()
	dead, err := c.Enqueue(ctx, work.New(item{ID: "dead"}))
	require.NoError(t, err)
	b.fetchAsDeadWorker(t, 20*time.Second)
	fresh, err := c.Enqueue(ctx, work.New(item{ID: "fresh"}))
	require.NoError(t, err)
	b.fetchAsDeadWorker(t, 0)
	b.orphan(t, dead.Job.ID, fresh.Job.ID)
	require.Equal(t, asynq.TaskStateActive, b.state(t, insp, dead.Job.ID))

	r := b.reconciler(t)
	n, err := r.Rescue(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	require.Equal(t, asynq.TaskStatePending, b.state(t, insp, dead.Job.ID))
	require.Equal(t, asynq.TaskStateActive, b.state(t, insp, fresh.Job.ID), "a task fetched a moment ago was taken away")
	q, err := insp.GetQueueInfo("default")
	require.NoError(t, err)
	require.Equal(t, 1, q.Pending)
	require.Equal(t, 1, q.Active)
	n, err = r.Rescue(ctx)
	require.NoError(t, err)
	require.Equal(t, 0, n, "a rescued job is not handed back twice")
	j, err := jobstore.NewStore(b.pool).Get(ctx, dead.Job.ID)
	require.NoError(t, err)
	require.Equal(t, idempotency.StatusRunning, j.Status, "the rescuer must leave the crash for the guard to count")

	var runs atomic.Int64
	b.worker(t, b.effectMux(&runs), func(c *server.Config) { c.DisableReconciler = true })
	testworker.WaitStatus(t, jobstore.NewStore(b.pool), dead.Job.ID, idempotency.StatusSucceeded, 10*time.Second)
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM effects WHERE job_id = $1`, dead.Job.ID))
}

// A server that is alive and runs the task keeps it, even when its ledger
// lease ran out (it lost touch with Postgres) and its asynq lease looks old.
func TestRescueLeavesATaskALiveServerRuns(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	c := b.client(t, b.opt)
	insp := asynq.NewInspector(b.opt)
	defer insp.Close()
	res, err := c.Enqueue(ctx, work.New(item{ID: "alive"}))
	require.NoError(t, err)

	started, release := make(chan struct{}), make(chan struct{})
	srv := asynq.NewServer(b.opt, asynq.Config{Concurrency: 1, Queues: map[string]int{"default": 1},
		LogLevel: asynq.FatalLevel})
	require.NoError(t, srv.Start(asynq.HandlerFunc(func(ctx context.Context, _ *asynq.Task) error {
		close(started)
		<-release
		return nil
	})))
	defer srv.Shutdown()
	defer close(release)
	<-started
	testenv.Eventually(t, 15*time.Second, func() bool {
		servers, err := insp.Servers()
		require.NoError(t, err)
		return len(servers) == 1 && len(servers[0].ActiveWorkers) == 1 && servers[0].ActiveWorkers[0].TaskID == res.Job.ID
	}, "the server never listed the task it runs")
	// As if its heartbeat had not extended the asynq lease for a while.
	rdb := redis.NewClient(&redis.Options{Addr: b.opt.Addr})
	defer rdb.Close()
	require.NoError(t, rdb.ZAdd(ctx, "asynq:{default}:lease", redis.Z{Score: float64(time.Now().Unix() + 5), Member: res.Job.ID}).Err())
	b.orphan(t, res.Job.ID)

	n, err := b.reconciler(t).Rescue(ctx)
	require.NoError(t, err)
	require.Equal(t, 0, n)
	require.Equal(t, asynq.TaskStateActive, b.state(t, insp, res.Job.ID))
}

// Tasks waiting for a later time go to their queue now; an archived copy is
// replaced and a missing one published again; a pending one is left alone.
func TestRescueHandsBackDelayedArchivedAndMissingTasks(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	c := b.client(t, b.opt)
	insp := asynq.NewInspector(b.opt)
	defer insp.Close()

	// A task asynq itself put in its retry set, an hour away (as its
	// recoverer does with a dead worker's task).
	retried, err := c.Enqueue(ctx, work.New(item{ID: "retried"}))
	require.NoError(t, err)
	failed := make(chan struct{})
	srv := asynq.NewServer(b.opt, asynq.Config{Concurrency: 1, Queues: map[string]int{"default": 1}, LogLevel: asynq.FatalLevel,
		RetryDelayFunc: func(int, error, *asynq.Task) time.Duration { return time.Hour }})
	var once sync.Once
	require.NoError(t, srv.Start(asynq.HandlerFunc(func(context.Context, *asynq.Task) error {
		once.Do(func() { close(failed) })
		return fmt.Errorf("worker lost")
	})))
	<-failed
	testenv.Eventually(t, 10*time.Second, func() bool {
		info, err := insp.GetTaskInfo("default", retried.Job.ID)
		return err == nil && info.State == asynq.TaskStateRetry
	}, "the task never reached asynq's retry set")
	srv.Shutdown()

	enqueue := func(key string, opts ...tasks.Option) string {
		res, err := c.Enqueue(ctx, work.New(item{ID: key}, opts...))
		require.NoError(t, err)
		return res.Job.ID
	}
	scheduled := enqueue("scheduled", tasks.Delay(time.Hour))
	archived := enqueue("archived", tasks.Delay(time.Hour))
	require.NoError(t, insp.ArchiveTask("default", archived))
	missing := enqueue("missing", tasks.Delay(time.Hour))
	require.NoError(t, insp.DeleteTask("default", missing))
	pending := enqueue("pending")
	live := enqueue("live", tasks.Delay(time.Hour))
	b.orphan(t, retried.Job.ID, scheduled, archived, missing, pending)
	_, err = b.pool.Exec(ctx, `UPDATE keel_jobs SET status = 'running', lease_holder = 'alive/1',
		lease_until = now() + interval '1 minute' WHERE id = $1`, live)
	require.NoError(t, err)
	_, err = b.pool.Exec(ctx, `UPDATE keel_jobs SET run_at = now() - interval '1 second'`)
	require.NoError(t, err)

	r := b.reconciler(t)
	n, err := r.Rescue(ctx)
	require.NoError(t, err)
	require.Equal(t, 4, n)
	for _, id := range []string{retried.Job.ID, scheduled, archived, missing, pending} {
		require.Equal(t, asynq.TaskStatePending, b.state(t, insp, id), id)
	}
	require.Equal(t, asynq.TaskStateScheduled, b.state(t, insp, live), "a job under a live lease was touched")
	n, err = r.Rescue(ctx)
	require.NoError(t, err)
	require.Equal(t, 0, n)
	q, err := insp.GetQueueInfo("default")
	require.NoError(t, err)
	require.Equal(t, 5, q.Pending)

	var runs atomic.Int64
	b.worker(t, b.effectMux(&runs), func(c *server.Config) { c.DisableReconciler = true })
	testenv.Eventually(t, 10*time.Second, func() bool {
		return b.count(t, `SELECT count(*) FROM keel_jobs WHERE status = 'succeeded'`) == 5
	}, "not every rescued job ran")
	require.Equal(t, 5, b.count(t, `SELECT count(DISTINCT job_id) FROM effects`))
	require.Equal(t, 5, b.count(t, `SELECT count(*) FROM effects`))
}

// Every worker runs a rescuer: at once, they still hand each job back once.
func TestConcurrentRescuersHandEachJobBackOnce(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	c := b.client(t, b.opt)
	const n = 60
	var ids []string
	for i := range n {
		res, err := c.Enqueue(ctx, work.New(item{ID: fmt.Sprint("many-", i)}))
		require.NoError(t, err)
		ids = append(ids, res.Job.ID)
		b.fetchAsDeadWorker(t, 20*time.Second)
	}
	b.orphan(t, ids...)
	var total atomic.Int64
	var wg sync.WaitGroup
	for range 4 {
		r := newReconciler(t, outbox.ReconcilerConfig{Pool: b.pool, Redis: b.opt, BatchSize: 7})
		wg.Go(func() {
			defer r.Close()
			k, err := r.Rescue(ctx)
			if err != nil {
				t.Error(err)
			}
			total.Add(int64(k))
		})
	}
	wg.Wait()
	require.EqualValues(t, n, total.Load())
	rdb := redis.NewClient(&redis.Options{Addr: b.opt.Addr})
	defer rdb.Close()
	queued, err := rdb.LRange(ctx, "asynq:{default}:pending", 0, -1).Result()
	require.NoError(t, err)
	require.ElementsMatch(t, ids, queued, "each job exactly once in its queue")
	require.Zero(t, rdb.LLen(ctx, "asynq:{default}:active").Val())
	require.Zero(t, rdb.ZCard(ctx, "asynq:{default}:lease").Val())
}

const childEnv = "KEEL_OUTBOX_CHILD"

// crashMux records every start of a job (committed at once) and makes its
// effect in the job's completing transaction; with hold it then waits there,
// where the test kills the process.
func crashMux(pool *pgxpool.Pool, hold bool) *tasks.Mux {
	mux := tasks.NewMux()
	tasks.Handle(mux, work, func(ctx context.Context, it item) error {
		id, _ := idempotency.JobID(ctx)
		if _, err := pool.Exec(ctx, `INSERT INTO started (job_id) VALUES ($1)`, id); err != nil {
			return err
		}
		return idempotency.InTx(ctx, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, `INSERT INTO effects (item, job_id) VALUES ($1, $2)`, it.ID, id); err != nil {
				return err
			}
			if hold {
				select {
				case <-ctx.Done():
				case <-time.After(time.Minute):
				}
			}
			return nil
		})
	})
	return mux
}

// runChildWorker runs a worker with keel's default settings when the test
// binary is started as the kill test's child.
func runChildWorker() bool {
	return testworker.RunChildWorker(childEnv, func(pool *pgxpool.Pool) (server.Config, asynq.Handler) {
		return server.Config{Redis: asynq.RedisClientOpt{Addr: os.Getenv("KEEL_CHILD_REDIS_ADDR")}}, crashMux(pool, true)
	})
}

// A worker killed with SIGKILL mid-job: another worker with keel's default
// settings starts the job again within seconds (asynq alone takes 61–92s),
// and its local effect happens once.
func TestKilledWorkersJobStartsAgainWithinSeconds(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	_, err := b.pool.Exec(ctx, `CREATE TABLE started (job_id text NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())`)
	require.NoError(t, err)
	c := b.client(t, b.opt)

	child := exec.Command(os.Args[0], "-test.run=^$")
	child.Env = append(os.Environ(), childEnv+"=1", testworker.ChildDatabaseURLEnv+"="+testenv.URL(b.schema),
		"KEEL_CHILD_REDIS_ADDR="+b.opt.Addr)
	child.Stdout, child.Stderr = os.Stderr, os.Stderr
	require.NoError(t, child.Start())
	t.Cleanup(func() { _ = child.Process.Kill(); _ = child.Wait() }) // if the test fails before the kill
	res, err := c.Enqueue(ctx, work.New(item{ID: "killed"}))
	require.NoError(t, err)
	testenv.Eventually(t, 20*time.Second, func() bool {
		return b.count(t, `SELECT count(*) FROM started`) == 1
	}, "the child never started the job")

	// The other worker, with the defaults, already runs when the child dies.
	srv := testworker.RunServer(t, server.Config{Redis: b.opt, Pool: b.pool}, crashMux(b.pool, false))
	require.NoError(t, child.Process.Signal(syscall.SIGKILL))
	killed := time.Now()
	_ = child.Wait()
	testenv.Eventually(t, 30*time.Second, func() bool {
		return b.count(t, `SELECT count(*) FROM started`) == 2
	}, "the job did not start again within 30s of the kill")
	took := time.Since(killed)
	t.Logf("SIGKILL → next start: %.1fs", took.Seconds())
	store := jobstore.NewStore(b.pool)
	j := testworker.WaitStatus(t, store, res.Job.ID, idempotency.StatusSucceeded, 10*time.Second)
	require.Equal(t, 2, j.Attempts)
	require.Equal(t, 1, b.count(t, `SELECT crashes FROM keel_jobs WHERE id = $1`, res.Job.ID),
		"the rescue must leave the crash for the next claim to count")
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM effects`), "the local effect must happen once")
	require.EqualValues(t, 1, srv.Reconciler().Stats().Rescued, "the other worker's rescuer handed it back")
}

// A worker that died after asynq's dequeue and before the ledger's claim
// (or after recording a failure and before asynq's retry) leaves an open
// row that is not running, and a task asynq thinks a worker has. The
// reconcile pass hands it back; otherwise only asynq's recoverer would, a
// minute or more later.
func TestReconcileHandsBackATaskADeadWorkerFetchedButNeverClaimed(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	c := b.client(t, b.opt)
	insp := asynq.NewInspector(b.opt)
	defer insp.Close()
	unclaimed, err := c.Enqueue(ctx, work.New(item{ID: "unclaimed"}))
	require.NoError(t, err)
	b.fetchAsDeadWorker(t, 20*time.Second)
	failed, err := c.Enqueue(ctx, work.New(item{ID: "failed"}))
	require.NoError(t, err)
	b.fetchAsDeadWorker(t, 20*time.Second)
	fresh, err := c.Enqueue(ctx, work.New(item{ID: "fresh"}))
	require.NoError(t, err)
	b.fetchAsDeadWorker(t, 0)
	_, err = b.pool.Exec(ctx, `UPDATE keel_jobs SET status = 'failed', attempts = 1 WHERE id = $1`, failed.Job.ID)
	require.NoError(t, err)
	_, err = b.pool.Exec(ctx, `UPDATE keel_jobs SET updated_at = now() - interval '1 hour'`)
	require.NoError(t, err)

	r := b.reconciler(t)
	_, err = r.Reconcile(ctx)
	require.NoError(t, err)
	require.Equal(t, asynq.TaskStatePending, b.state(t, insp, unclaimed.Job.ID))
	require.Equal(t, asynq.TaskStatePending, b.state(t, insp, failed.Job.ID))
	require.Equal(t, asynq.TaskStateActive, b.state(t, insp, fresh.Job.ID), "a task fetched a moment ago was taken away")

	var runs atomic.Int64
	b.worker(t, b.effectMux(&runs), func(c *server.Config) { c.DisableReconciler = true })
	store := jobstore.NewStore(b.pool)
	testworker.WaitStatus(t, store, unclaimed.Job.ID, idempotency.StatusSucceeded, 10*time.Second)
	testworker.WaitStatus(t, store, failed.Job.ID, idempotency.StatusSucceeded, 10*time.Second)
}
