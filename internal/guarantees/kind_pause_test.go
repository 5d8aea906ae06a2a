package guarantees_test

import (
	"context"
	"fmt"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/asynqwire"
	"github.com/keeljobs/keel/internal/testenv"
	"github.com/keeljobs/keel/internal/testworker"
	"github.com/keeljobs/keel/server"
	"github.com/keeljobs/keel/tasks"
)

// Two kinds sharing one queue: pausedKind is paused, otherKind goes on.
var (
	pausedKind = tasks.Define[item]("hunt:paused", tasks.MaxRetry(2), tasks.Key(func(i item) string { return i.ID }))
	otherKind  = tasks.Define[item]("hunt:unpaused", tasks.MaxRetry(2), tasks.Key(func(i item) string { return i.ID }))
)

// kindPauseHandlers: a job keyed "gate" waits for a row in kind_gate (the
// test opens it); every other job commits its effect at once.
func kindPauseHandlers(mux *tasks.Mux, pool *pgxpool.Pool) {
	h := func(ctx context.Context, it item) error {
		if err := started(ctx, pool); err != nil {
			return err
		}
		for it.ID == "gate" {
			var open bool
			if err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM kind_gate)`).Scan(&open); err != nil {
				return err
			}
			if open {
				break
			}
			select {
			case <-time.After(20 * time.Millisecond):
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		return effect(ctx)
	}
	tasks.Handle(mux, pausedKind, h)
	tasks.Handle(mux, otherKind, h)
}

// A paused kind's jobs start on no worker while a running one finishes
// and the other kinds of its queue run; the jobs wait held (paused) in the
// ledger, including those enqueued during the pause, through a Redis that
// loses its data and new worker processes; the resume runs each once.
func TestAPausedKindWaitsOnEveryWorkerThroughAFlushedRedis(t *testing.T) {
	e := setup(t)
	ctx := context.Background()
	_, err := e.pool.Exec(ctx, `CREATE TABLE kind_gate (open boolean)`)
	require.NoError(t, err)
	a, b := e.startChild(t, "kind-pause"), e.startChild(t, "kind-pause")

	gate, err := e.client.Enqueue(ctx, pausedKind.New(item{ID: "gate"}))
	require.NoError(t, err)
	testenv.Eventually(t, 30*time.Second, func() bool {
		return e.count(t, `SELECT count(*) FROM started WHERE job_id = $1`, gate.Job.ID) == 1
	}, "the first job never started")
	// Queued before the pause: due in a moment, in Redis's schedule.
	var held []string
	for i := range 3 {
		r, err := e.client.Enqueue(ctx, pausedKind.New(item{ID: fmt.Sprintf("before-%d", i)}, tasks.Delay(2*time.Second)))
		require.NoError(t, err)
		held = append(held, r.Job.ID)
	}

	ops := e.client.Inspector()
	changed, err := ops.PauseKind(ctx, pausedKind.Name(), "ops", "the supplier is down")
	require.NoError(t, err)
	require.True(t, changed)
	changed, err = ops.PauseKind(ctx, pausedKind.Name(), "ops", "again")
	require.NoError(t, err)
	require.False(t, changed, "paused already")
	for _, id := range held {
		testworker.WaitStatus(t, e.store, id, idempotency.StatusPaused, 10*time.Second)
	}
	// Enqueued during the pause: published at once, held at its delivery.
	var others []string
	for i := range 4 {
		r, err := e.client.Enqueue(ctx, pausedKind.New(item{ID: fmt.Sprintf("during-%d", i)}))
		require.NoError(t, err)
		held = append(held, r.Job.ID)
		o, err := e.client.Enqueue(ctx, otherKind.New(item{ID: fmt.Sprintf("other-%d", i)}))
		require.NoError(t, err)
		others = append(others, o.Job.ID)
	}
	for _, id := range others {
		testworker.WaitStatus(t, e.store, id, idempotency.StatusSucceeded, 20*time.Second)
	}
	for _, id := range held {
		testworker.WaitStatus(t, e.store, id, idempotency.StatusPaused, 20*time.Second)
	}
	// Held, not postponed: Redis keeps no copy to deliver again and again.
	rdb := redis.NewClient(&redis.Options{Addr: e.redis.Addr()})
	defer rdb.Close()
	testenv.Eventually(t, 10*time.Second, func() bool {
		for _, id := range held {
			if rdb.Exists(ctx, asynqwire.TaskKey("default", id)).Val() != 0 {
				return false
			}
		}
		return true
	}, "a held job's task is still in Redis")
	// The run that began before the pause finishes under it.
	_, err = e.pool.Exec(ctx, `INSERT INTO kind_gate VALUES (true)`)
	require.NoError(t, err)
	testworker.WaitStatus(t, e.store, gate.Job.ID, idempotency.StatusSucceeded, 20*time.Second)

	// Redis loses everything; both workers die and a new one starts.
	require.NoError(t, rdb.FlushAll(ctx).Err())
	require.NoError(t, a.cmd.Process.Signal(syscall.SIGKILL))
	require.NoError(t, b.cmd.Process.Signal(syscall.SIGKILL))
	e.startChild(t, "kind-pause")
	after, err := e.client.Enqueue(ctx, otherKind.New(item{ID: "after-flush"}))
	require.NoError(t, err)
	late, err := e.client.Enqueue(ctx, pausedKind.New(item{ID: "after-flush"}))
	require.NoError(t, err)
	held = append(held, late.Job.ID)
	testworker.WaitStatus(t, e.store, after.Job.ID, idempotency.StatusSucceeded, 30*time.Second)
	testworker.WaitStatus(t, e.store, late.Job.ID, idempotency.StatusPaused, 30*time.Second)
	for _, id := range held {
		j, err := e.store.Get(ctx, id)
		require.NoError(t, err)
		require.Equal(t, idempotency.StatusPaused, j.Status, "job %s", id)
		require.Zero(t, e.count(t, `SELECT count(*) FROM started WHERE job_id = $1`, id), "a paused kind's job %s started", id)
	}
	// The same business action again: the held job, still held.
	dup, err := e.client.Enqueue(ctx, pausedKind.New(item{ID: "during-0"}))
	require.NoError(t, err)
	require.True(t, dup.Existed)
	require.Equal(t, held[3], dup.Job.ID)
	require.False(t, dup.Published)
	paused, err := ops.PausedKinds(ctx)
	require.NoError(t, err)
	require.Len(t, paused, 1)
	require.Equal(t, pausedKind.Name(), paused[0].Kind)
	require.Equal(t, int64(len(held)), paused[0].Held)

	changed, err = ops.ResumeKind(ctx, pausedKind.Name(), "ops", "the supplier is back")
	require.NoError(t, err)
	require.True(t, changed)
	for _, id := range held {
		testworker.WaitStatus(t, e.store, id, idempotency.StatusSucceeded, 30*time.Second)
	}
	for _, id := range append(held, gate.Job.ID) {
		require.Equal(t, 1, e.effects(t, id), "job %s", id)
	}
	for _, id := range held {
		require.Equal(t, 1, e.count(t, `SELECT count(*) FROM started WHERE job_id = $1`, id), "job %s ran more than once", id)
	}
	require.Equal(t, 2, e.count(t, `SELECT count(*) FROM keel_audit WHERE action IN ('pause-kind:hunt:paused', 'resume-kind:hunt:paused')`))
}

// The joints of a kind's pause: a dependent released while its kind is
// paused, a dead job replayed meanwhile and one enqueued for later are
// held; a held job can be cancelled, and the resume leaves it so; a held
// job's deadline ends it; the others run once each after the resume.
func TestAPausedKindHoldsReleasedReplayedAndCancelledJobs(t *testing.T) {
	e := setup(t)
	depsTables(t, e)
	ctx := context.Background()
	_, err := e.pool.Exec(ctx, `CREATE TABLE kind_gate (open boolean)`)
	require.NoError(t, err)
	mux := tasks.NewMux()
	kindPauseHandlers(mux, e.pool)
	tasks.Handle(mux, depKind, depHandler(e.pool, nil))
	cfg := server.Config{Redis: e.redisOpt(), Pool: e.pool, Concurrency: 4, ShutdownTimeout: time.Second}
	cfg.Retry.Base, cfg.Retry.Cap = 100*time.Millisecond, 100*time.Millisecond
	cfg.Reconciler.Interval, cfg.Reconciler.Grace = 200*time.Millisecond, 200*time.Millisecond
	testworker.RunServer(t, cfg, mux)
	ops := e.client.Inspector()

	dead, err := e.client.Enqueue(ctx, depKind.New(item{ID: "fail-once-1"}))
	require.NoError(t, err)
	testworker.WaitStatus(t, e.store, dead.Job.ID, idempotency.StatusDead, 20*time.Second)
	parent, err := e.client.Enqueue(ctx, pausedKind.New(item{ID: "gate"}))
	require.NoError(t, err)
	child, err := e.client.Enqueue(ctx, depKind.New(item{ID: "child"}, tasks.After(parent.Job.ID)))
	require.NoError(t, err)
	later, err := e.client.Enqueue(ctx, depKind.New(item{ID: "later"}, tasks.Delay(time.Hour)))
	require.NoError(t, err)

	_, err = ops.PauseKind(ctx, depKind.Name(), "ops", "the supplier is down")
	require.NoError(t, err)
	testworker.WaitStatus(t, e.store, later.Job.ID, idempotency.StatusPaused, 10*time.Second)
	// Held at its delivery; its deadline ends it while its kind is paused.
	expiring, err := e.client.Enqueue(ctx, depKind.New(item{ID: "expiring"}, tasks.Deadline(time.Now().Add(2*time.Second))))
	require.NoError(t, err)
	testworker.WaitStatus(t, e.store, expiring.Job.ID, idempotency.StatusPaused, 10*time.Second)
	j := testworker.WaitStatus(t, e.store, expiring.Job.ID, idempotency.StatusDead, 20*time.Second)
	require.Equal(t, "deadline", j.ErrorClass)
	cancelled, err := ops.Cancel(ctx, later.Job.ID, "ops", "not needed after all")
	require.NoError(t, err)
	require.False(t, cancelled.AlreadyCancelled)
	_, err = ops.Replay(ctx, dead.Job.ID, "ops", "the warehouse is back")
	require.NoError(t, err)
	_, err = e.pool.Exec(ctx, `INSERT INTO kind_gate VALUES (true)`)
	require.NoError(t, err)
	testworker.WaitStatus(t, e.store, parent.Job.ID, idempotency.StatusSucceeded, 20*time.Second)
	testworker.WaitStatus(t, e.store, child.Job.ID, idempotency.StatusPaused, 20*time.Second)
	testworker.WaitStatus(t, e.store, dead.Job.ID, idempotency.StatusPaused, 20*time.Second)
	require.Zero(t, e.count(t, `SELECT count(*) FROM started WHERE job_id = $1`, child.Job.ID))

	_, err = ops.ResumeKind(ctx, depKind.Name(), "ops", "back")
	require.NoError(t, err)
	testworker.WaitStatus(t, e.store, child.Job.ID, idempotency.StatusSucceeded, 20*time.Second)
	testworker.WaitStatus(t, e.store, dead.Job.ID, idempotency.StatusSucceeded, 20*time.Second)
	for _, id := range []string{child.Job.ID, dead.Job.ID, parent.Job.ID} {
		require.Equal(t, 1, e.effects(t, id), "job %s", id)
	}
	j, err = e.store.Get(ctx, later.Job.ID)
	require.NoError(t, err)
	require.Equal(t, idempotency.StatusCancelled, j.Status)
	for _, id := range []string{later.Job.ID, expiring.Job.ID} {
		require.Zero(t, e.count(t, `SELECT count(*) FROM started WHERE job_id = $1`, id))
	}
	e.noEarlyRuns(t)
}
