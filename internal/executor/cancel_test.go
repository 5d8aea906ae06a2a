package executor_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/inspect"
	"github.com/keeljobs/keel/internal/executor"
	"github.com/keeljobs/keel/internal/testenv"
	"github.com/keeljobs/keel/internal/testworker"
	"github.com/keeljobs/keel/server"
	"github.com/keeljobs/keel/tasks"
)

var stoppable = tasks.Define[order]("test:stoppable", tasks.MaxRetry(3), tasks.Key(func(o order) string { return o.OrderID }))

// queueEmpty reports whether asynq holds no task at all in queue.
func queueEmpty(insp *asynq.Inspector, queue string) bool {
	q, err := insp.GetQueueInfo(queue)
	return errors.Is(err, asynq.ErrQueueNotFound) || (err == nil && q.Size == 0 && q.Active == 0)
}

func TestCancelScheduledJobRemovesItsTaskAndAnyCopyIsAcknowledged(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	insp := inspector(t, b)
	res, err := b.client.Enqueue(ctx, stoppable.New(order{OrderID: "later"}, tasks.Delay(time.Hour)))
	require.NoError(t, err)
	require.True(t, res.Published)
	_, err = insp.GetTaskInfo(res.Job.Queue, res.Job.ID)
	require.NoError(t, err, "the scheduled task is in Redis before the cancel")

	out, err := testworker.Ops(t, b.store, insp).Cancel(ctx, res.Job.ID, "alice", "customer withdrew")
	require.NoError(t, err)
	require.NoError(t, out.RedisErr)
	require.False(t, out.AlreadyCancelled)
	require.False(t, out.WasRunning)
	require.Equal(t, idempotency.StatusCancelled, out.Job.Status)
	require.Equal(t, "alice", out.Job.ResolvedBy)
	require.Equal(t, "customer withdrew", out.Job.ResolutionNote)
	require.NotNil(t, out.Job.FinishedAt)
	_, err = insp.GetTaskInfo(res.Job.Queue, res.Job.ID)
	require.ErrorIs(t, err, asynq.ErrTaskNotFound, "the cancel removes the task from Redis")
	entries, err := testworker.Ops(t, b.store, nil).Audit(ctx, res.Job.ID)
	require.NoError(t, err)
	require.Len(t, entries, 1)
	require.Equal(t, "cancel", entries[0].Action)
	require.Equal(t, "alice", entries[0].Actor)
	require.Equal(t, "customer withdrew", entries[0].Note)

	// A copy still somewhere (a publish in flight during the cancel) is
	// acknowledged without running the handler.
	var runs atomic.Int32
	mux := tasks.NewMux()
	tasks.Handle(mux, stoppable, func(ctx context.Context, o order) error { runs.Add(1); return nil })
	ac := asynq.NewClient(b.redis)
	defer ac.Close()
	_, err = ac.Enqueue(asynq.NewTask(res.Job.Kind, res.Job.Payload), asynq.TaskID(res.Job.ID), asynq.Queue(res.Job.Queue))
	require.NoError(t, err)
	var signals *executor.TestSignals
	b.startWorker(t, mux, func(c *server.Config) { signals = executor.InitTestSignals(&c.Guard) })
	require.Equal(t, res.Job.ID, signals.Skipped.Wait(t), "the copy was never delivered")
	require.Zero(t, runs.Load(), "a cancelled job ran")
	testenv.Eventually(t, 15*time.Second, func() bool { return queueEmpty(insp, res.Job.Queue) }, "the copy was not acknowledged")
	j, err := b.store.Get(ctx, res.Job.ID)
	require.NoError(t, err)
	require.Equal(t, idempotency.StatusCancelled, j.Status)

	// One action, one job: the same business key again is the cancelled job.
	again, err := b.client.Enqueue(ctx, stoppable.New(order{OrderID: "later"}))
	require.NoError(t, err)
	require.True(t, again.Existed)
	require.Equal(t, idempotency.StatusCancelled, again.Job.Status)
}

func TestCancelJobWaitingForItsRetry(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	insp := inspector(t, b)
	var runs atomic.Int32
	mux := tasks.NewMux()
	tasks.Handle(mux, stoppable, func(ctx context.Context, o order) error {
		runs.Add(1)
		return errors.New("the mail server said no")
	})
	b.startWorker(t, mux, func(c *server.Config) { c.Retry.Base, c.Retry.Cap = time.Hour, time.Hour })
	res, err := b.client.Enqueue(ctx, stoppable.New(order{OrderID: "retrying"}))
	require.NoError(t, err)
	b.waitStatus(t, res.Job.ID, idempotency.StatusFailed, 15*time.Second)
	testenv.Eventually(t, 10*time.Second, func() bool {
		info, err := insp.GetTaskInfo(res.Job.Queue, res.Job.ID)
		return err == nil && info.State == asynq.TaskStateRetry
	}, "the failed attempt never reached asynq's retry set")

	out, err := testworker.Ops(t, b.store, insp).Cancel(ctx, res.Job.ID, "bob", "")
	require.NoError(t, err)
	require.NoError(t, out.RedisErr)
	require.Equal(t, idempotency.StatusCancelled, out.Job.Status)
	_, err = insp.GetTaskInfo(res.Job.Queue, res.Job.ID)
	require.ErrorIs(t, err, asynq.ErrTaskNotFound)
	require.EqualValues(t, 1, runs.Load())
}

// runningHandler blocks until its context ends, then tries a step and the
// completing InTx as a handler that ignores cancellation would.
type runningHandler struct {
	started                   chan string
	lateStep, lateInTx, cause chan error
	runs, calls               atomic.Int32
}

func newRunningHandler() *runningHandler {
	return &runningHandler{started: make(chan string, 10), lateStep: make(chan error, 10), lateInTx: make(chan error, 10),
		cause: make(chan error, 10)}
}

func (h *runningHandler) handle(ctx context.Context, _ order) error {
	h.runs.Add(1)
	id, _ := idempotency.JobID(ctx)
	h.started <- id
	<-ctx.Done()
	h.cause <- context.Cause(ctx)
	h.lateStep <- idempotency.Step(ctx, "mail", func(ctx context.Context, key string) error {
		h.calls.Add(1)
		return nil
	})
	err := idempotency.InTx(ctx, func(tx pgx.Tx) error {
		_, err := tx.Exec(context.WithoutCancel(ctx), `INSERT INTO effects (job_id, name) VALUES ($1, 'late')`, id)
		return err
	})
	h.lateInTx <- err
	return err
}

func TestCancelRunningJobStopsItsHandlerAndNothingLateCommits(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	insp := inspector(t, b)
	h := newRunningHandler()
	mux := tasks.NewMux()
	tasks.Handle(mux, stoppable, h.handle)
	cancelled := make(chan string, 4)
	srv := b.startWorker(t, mux, func(c *server.Config) {
		c.Retry.Base, c.Retry.Cap = 100*time.Millisecond, 200*time.Millisecond
		c.Guard.OnCancelled = func(_ context.Context, e executor.CancelEvent) { cancelled <- e.JobID }
	})
	res, err := b.client.Enqueue(ctx, stoppable.New(order{OrderID: "running"}))
	require.NoError(t, err)
	require.Equal(t, res.Job.ID, <-h.started)
	b.waitStatus(t, res.Job.ID, idempotency.StatusRunning, 5*time.Second)

	out, err := testworker.Ops(t, b.store, insp).Cancel(ctx, res.Job.ID, "carol", "wrong address")
	require.NoError(t, err)
	require.True(t, out.WasRunning)
	require.NoError(t, out.RedisErr)

	<-h.cause // asynq cancelled the handler's context
	require.ErrorIs(t, <-h.lateStep, idempotency.ErrCancelled)
	require.ErrorIs(t, <-h.lateInTx, idempotency.ErrCancelled)
	select {
	case id := <-cancelled:
		require.Equal(t, res.Job.ID, id)
	case <-time.After(10 * time.Second):
		t.Fatal("the guard did not count the cancel")
	}
	require.EqualValues(t, 1, srv.GuardStats().Cancelled)
	// asynq counts its own cancel as a failure and schedules a retry: that
	// delivery finds the job cancelled and is acknowledged.
	testenv.Eventually(t, 15*time.Second, func() bool { return queueEmpty(insp, res.Job.Queue) }, "asynq kept the task")
	require.Empty(t, cancelled, "the cancel was counted twice")
	require.EqualValues(t, 1, h.runs.Load(), "a cancelled job ran again")
	require.Zero(t, h.calls.Load(), "a late step made its call")
	require.Zero(t, b.count(t, `SELECT count(*) FROM effects`), "a late InTx committed")
	j, err := b.store.Get(ctx, res.Job.ID)
	require.NoError(t, err)
	require.Equal(t, idempotency.StatusCancelled, j.Status)
	require.Equal(t, 1, j.Attempts)
	stats := srv.GuardStats()
	require.Zero(t, stats.Dead)
	require.Zero(t, stats.Failed)
}

// The pub/sub message asynq sends for a cancel can be lost; the guard sees
// the ledger's cancel at its next lease renewal and stops the run itself.
func TestCancelRunningJobHoldsWithoutAsynqsMessage(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	insp := inspector(t, b)
	h := newRunningHandler()
	mux := tasks.NewMux()
	tasks.Handle(mux, stoppable, h.handle)
	srv := b.startWorker(t, mux, func(c *server.Config) { c.Guard.Lease = time.Second })
	res, err := b.client.Enqueue(ctx, stoppable.New(order{OrderID: "no-message"}))
	require.NoError(t, err)
	require.Equal(t, res.Job.ID, <-h.started)

	out, err := testworker.Ops(t, b.store, nil).Cancel(ctx, res.Job.ID, "dave", "")
	require.NoError(t, err)
	require.True(t, out.WasRunning)

	require.ErrorIs(t, <-h.cause, idempotency.ErrCancelled, "the guard cancelled the handler's context")
	require.ErrorIs(t, <-h.lateStep, idempotency.ErrCancelled)
	require.ErrorIs(t, <-h.lateInTx, idempotency.ErrCancelled)
	testenv.Eventually(t, 10*time.Second, func() bool { return queueEmpty(insp, res.Job.Queue) }, "the delivery was not acknowledged")
	require.EqualValues(t, 1, srv.GuardStats().Cancelled)
	require.EqualValues(t, 1, h.runs.Load())
	require.Zero(t, h.calls.Load())
	require.Zero(t, b.count(t, `SELECT count(*) FROM effects`))
}

// A cancel racing the job's completing InTx: each job ends either succeeded
// with its effect or cancelled without it, and the cancel's answer agrees.
func TestCancelRacingCompletionHasOneWinner(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	insp := inspector(t, b)
	const n = 8 // within the worker's concurrency: all run at once
	release := make(chan struct{})
	started := make(chan string, n)
	mux := tasks.NewMux()
	tasks.Handle(mux, stoppable, func(ctx context.Context, o order) error {
		id, _ := idempotency.JobID(ctx)
		started <- id
		<-release
		return idempotency.InTx(context.WithoutCancel(ctx), func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `INSERT INTO effects (job_id, name) VALUES ($1, 'done')`, id)
			return err
		})
	})
	b.startWorker(t, mux, nil)
	ids := make([]string, n)
	for i := range ids {
		res, err := b.client.Enqueue(ctx, stoppable.New(order{OrderID: fmt.Sprint("race-", i)}))
		require.NoError(t, err)
		ids[i] = res.Job.ID
	}
	for range ids {
		<-started
	}
	cancelErrs := make([]error, n)
	var wg sync.WaitGroup
	for i, id := range ids {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, cancelErrs[i] = testworker.Ops(t, b.store, insp).Cancel(ctx, id, "race", "")
		}()
	}
	close(release)
	wg.Wait()
	for i, id := range ids {
		var j idempotency.Job
		testenv.Eventually(t, 15*time.Second, func() bool {
			var err error
			j, err = b.store.Get(ctx, id)
			return err == nil && j.Status.Terminal()
		}, "job %s never ended", id)
		effects := b.count(t, `SELECT count(*) FROM effects WHERE job_id = $1`, id)
		switch j.Status {
		case idempotency.StatusSucceeded:
			require.ErrorIs(t, cancelErrs[i], inspect.ErrNotCancellable, "job %s", id)
			require.ErrorContains(t, cancelErrs[i], "succeeded")
			require.Equal(t, 1, effects)
		case idempotency.StatusCancelled:
			require.NoError(t, cancelErrs[i], "job %s", id)
			require.Zero(t, effects, "job %s was cancelled yet its effect committed", id)
		default:
			t.Fatalf("job %s ended %s", id, j.Status)
		}
	}
}

func TestCancelRefusalsAndRepeats(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	insp := inspector(t, b)
	mk := func(key string, status idempotency.Status) string {
		res, err := b.client.Enqueue(ctx, stoppable.New(order{OrderID: key}, tasks.Delay(time.Hour)))
		require.NoError(t, err)
		_, err = b.pool.Exec(ctx, `UPDATE keel_jobs SET status = $2 WHERE id = $1`, res.Job.ID, status)
		require.NoError(t, err)
		return res.Job.ID
	}
	for _, st := range []idempotency.Status{idempotency.StatusSucceeded, idempotency.StatusDead, idempotency.StatusDiscarded} {
		id := mk(string(st), st)
		_, err := testworker.Ops(t, b.store, insp).Cancel(ctx, id, "erin", "")
		require.ErrorIs(t, err, inspect.ErrNotCancellable, "%s", st)
		require.ErrorContains(t, err, string(st))
		j, err := b.store.Get(ctx, id)
		require.NoError(t, err)
		require.Equal(t, st, j.Status, "a refused cancel changed the job")
	}

	_, err := testworker.Ops(t, b.store, insp).Cancel(ctx, "0193aaaa-0000-7000-8000-000000000000", "erin", "")
	require.ErrorIs(t, err, idempotency.ErrNotFound)
	id := mk("twice", idempotency.StatusPending)
	_, err = testworker.Ops(t, b.store, insp).Cancel(ctx, id, " ", "")
	require.ErrorIs(t, err, inspect.ErrActorRequired)

	first, err := testworker.Ops(t, b.store, insp).Cancel(ctx, id, "erin", "first")
	require.NoError(t, err)
	require.False(t, first.AlreadyCancelled)
	second, err := testworker.Ops(t, b.store, insp).Cancel(ctx, id, "frank", "second")
	require.NoError(t, err)
	require.True(t, second.AlreadyCancelled)
	require.Equal(t, "erin", second.Job.ResolvedBy, "the first cancel's record stands")
	entries, err := testworker.Ops(t, b.store, nil).Audit(ctx, id)
	require.NoError(t, err)
	require.Len(t, entries, 1)

	_, err = testworker.Ops(t, b.store, insp).Replay(ctx, id, "erin", "")
	require.ErrorIs(t, err, inspect.ErrNotDead, "a cancelled job is not replayed")
	_, err = testworker.Ops(t, b.store, insp).Discard(ctx, id, "erin", "why")
	require.ErrorIs(t, err, inspect.ErrNotDead)

	byKey := mk("by-key", idempotency.StatusPending)
	out, err := testworker.Ops(t, b.store, insp).CancelByKey(ctx, stoppable.Name(), "by-key", "erin", "")
	require.NoError(t, err)
	require.Equal(t, byKey, out.Job.ID)
	_, err = testworker.Ops(t, b.store, insp).CancelByKey(ctx, stoppable.Name(), "no-such-key", "erin", "")
	require.ErrorIs(t, err, idempotency.ErrNotFound)
}
