package guarantees_test

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/asynqwire"
	"github.com/keeljobs/keel/internal/testenv"
	"github.com/keeljobs/keel/internal/testworker"
	"github.com/keeljobs/keel/server"
	"github.com/keeljobs/keel/tasks"
)

// A paused queue's jobs do not start on any worker while a running one
// finishes; the pause outlives a Redis that loses its data (a reconciler
// pass puts it back) and a new worker; a resume runs what waited, once.
func TestAPausedQueueStaysPausedThroughAFlushedRedis(t *testing.T) {
	e := setup(t)
	depsTables(t, e)
	ctx := context.Background()
	open := make(chan struct{})
	worker := func() {
		mux := tasks.NewMux()
		tasks.Handle(mux, depKind, depHandler(e.pool, func(ctx context.Context, _ string) error {
			select {
			case <-open:
				return nil
			case <-ctx.Done():
				return ctx.Err()
			}
		}))
		cfg := server.Config{Redis: e.redisOpt(), Pool: e.pool, Concurrency: 4, ShutdownTimeout: time.Second}
		cfg.Reconciler.Interval, cfg.Reconciler.Grace = 200*time.Millisecond, 200*time.Millisecond
		testworker.RunServer(t, cfg, mux)
	}
	worker()
	running, err := e.client.Enqueue(ctx, depKind.New(item{ID: "gate-running"}, tasks.Queue("low")))
	require.NoError(t, err)
	testenv.Eventually(t, 20*time.Second, func() bool {
		return e.count(t, `SELECT count(*) FROM started WHERE job_id = $1`, running.Job.ID) == 1
	}, "the first job never started")

	ops := e.client.Inspector()
	changed, err := ops.PauseQueue(ctx, "low", "ops", "the warehouse is closed")
	require.NoError(t, err)
	require.True(t, changed)
	held, err := e.client.Enqueue(ctx, depKind.New(item{ID: "held"}, tasks.Queue("low")))
	require.NoError(t, err)
	close(open) // the running job finishes under the pause
	testworker.WaitStatus(t, e.store, running.Job.ID, idempotency.StatusSucceeded, 20*time.Second)
	other, err := e.client.Enqueue(ctx, depKind.New(item{ID: "elsewhere"}, tasks.Queue("default")))
	require.NoError(t, err)
	testworker.WaitStatus(t, e.store, other.Job.ID, idempotency.StatusSucceeded, 20*time.Second)

	// Redis loses everything, the pause with it; a second worker starts.
	rdb := redis.NewClient(&redis.Options{Addr: e.redis.Addr()})
	defer rdb.Close()
	require.NoError(t, rdb.FlushAll(ctx).Err())
	worker()
	testenv.Eventually(t, 20*time.Second, func() bool {
		paused, err := asynqwire.Paused(ctx, rdb, "low")
		require.NoError(t, err)
		return paused && rdb.Exists(ctx, asynqwire.TaskKey("low", held.Job.ID)).Val() == 1
	}, "the reconciler did not pause the queue again and publish its job")
	// A job of another queue, published after the held one was, runs: the
	// workers were taking work, and left the paused queue alone.
	after, err := e.client.Enqueue(ctx, depKind.New(item{ID: "after-flush"}, tasks.Queue("default")))
	require.NoError(t, err)
	testworker.WaitStatus(t, e.store, after.Job.ID, idempotency.StatusSucceeded, 20*time.Second)
	j, err := e.store.Get(ctx, held.Job.ID)
	require.NoError(t, err)
	require.Equal(t, idempotency.StatusPending, j.Status)
	require.Zero(t, e.count(t, `SELECT count(*) FROM started WHERE job_id = $1`, held.Job.ID), "a paused queue's job started")

	resumeRunsOnce(t, e, held.Job.ID)
}

// resumeRunsOnce resumes queue low and waits for its held job id to
// succeed, its effect written once.
func resumeRunsOnce(t *testing.T, e *env, id string) {
	t.Helper()
	changed, err := e.client.Inspector().ResumeQueue(context.Background(), "low", "ops", "open again")
	require.NoError(t, err)
	require.True(t, changed)
	testworker.WaitStatus(t, e.store, id, idempotency.StatusSucceeded, 20*time.Second)
	require.Equal(t, 1, e.effects(t, id))
}

// A job enqueued into a paused queue after Redis lost the pause, before
// any reconciler pass has put it back, does not run either: its claim
// finds the ledger's pause and holds it there, as a paused kind's job is
// held, and the resume hands it to the relay, which runs it once.
func TestAPausedQueuesJobWaitsWhileRedisHasLostThePause(t *testing.T) {
	e := setup(t)
	depsTables(t, e)
	ctx := context.Background()
	mux := tasks.NewMux()
	tasks.Handle(mux, depKind, depHandler(e.pool, func(context.Context, string) error { return nil }))
	// No reconciler: the pass that would pause the queue again in Redis is
	// what has not come yet.
	testworker.RunServer(t, server.Config{Redis: e.redisOpt(), Pool: e.pool, Concurrency: 4, DisableReconciler: true}, mux)

	ops := e.client.Inspector()
	changed, err := ops.PauseQueue(ctx, "low", "ops", "the warehouse is closed")
	require.NoError(t, err)
	require.True(t, changed)
	rdb := redis.NewClient(&redis.Options{Addr: e.redis.Addr()})
	defer rdb.Close()
	require.NoError(t, rdb.FlushAll(ctx).Err())

	held, err := e.client.Enqueue(ctx, depKind.New(item{ID: "after-the-flush"}, tasks.Queue("low")))
	require.NoError(t, err)
	require.True(t, held.Published, "published into a queue Redis no longer holds paused")
	testworker.WaitStatus(t, e.store, held.Job.ID, idempotency.StatusPaused, 20*time.Second)
	// Held, not postponed: Redis keeps no copy to deliver again and again.
	testenv.Eventually(t, 10*time.Second, func() bool {
		return rdb.Exists(ctx, asynqwire.TaskKey("low", held.Job.ID)).Val() == 0
	}, "the held job's task is still in Redis")
	other, err := e.client.Enqueue(ctx, depKind.New(item{ID: "elsewhere"}, tasks.Queue("default")))
	require.NoError(t, err)
	testworker.WaitStatus(t, e.store, other.Job.ID, idempotency.StatusSucceeded, 20*time.Second)
	require.Zero(t, e.count(t, `SELECT count(*) FROM started WHERE job_id = $1`, held.Job.ID), "a paused queue's job started")

	resumeRunsOnce(t, e, held.Job.ID)
	require.Equal(t, 1, e.count(t, `SELECT count(*) FROM started WHERE job_id = $1`, held.Job.ID))
}
