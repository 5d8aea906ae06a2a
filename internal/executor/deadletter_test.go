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
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/inspect"
	"github.com/keeljobs/keel/internal/executor"
	"github.com/keeljobs/keel/internal/jobstore"
	"github.com/keeljobs/keel/internal/testenv"
	"github.com/keeljobs/keel/internal/testworker"
	"github.com/keeljobs/keel/internal/wake"
	"github.com/keeljobs/keel/retry"
	"github.com/keeljobs/keel/server"
	"github.com/keeljobs/keel/tasks"
)

// deadEvents records what the guard's OnDead hook is told.
type deadEvents struct {
	mu  sync.Mutex
	evs []jobstore.DeadEvent
}

func (d *deadEvents) record(_ context.Context, e jobstore.DeadEvent) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.evs = append(d.evs, e)
}

// of returns the events about one job.
func (d *deadEvents) of(id string) []jobstore.DeadEvent {
	d.mu.Lock()
	defer d.mu.Unlock()
	var out []jobstore.DeadEvent
	for _, e := range d.evs {
		if e.JobID == id {
			out = append(out, e)
		}
	}
	return out
}

func onDead(d *deadEvents) func(*server.Config) {
	return func(c *server.Config) { c.Guard.OnDead = d.record }
}

func inspector(t *testing.T, b *bundle) *asynq.Inspector {
	t.Helper()
	insp := asynq.NewInspector(b.redis)
	t.Cleanup(func() { insp.Close() })
	return insp
}

// hurryRetries runs the tasks of queue that wait in asynq's retry set at
// once, until the test ends, and announces them as keel's publishes do: an
// idle worker would otherwise find them only when its wait for announced
// work ends (IdleWait). These tests are about what happens between
// attempts, not when; the retry count a task carries is unchanged.
func hurryRetries(t *testing.T, b *bundle, queue string) {
	t.Helper()
	insp := inspector(t, b)
	rdb := redis.NewClient(&redis.Options{Addr: b.redis.Addr, DB: b.redis.DB})
	t.Cleanup(func() { rdb.Close() })
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		tick := time.NewTicker(50 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
			if n, err := insp.RunAllRetryTasks(queue); err == nil && n > 0 {
				rdb.Publish(ctx, wake.Channel, queue)
			}
		}
	}()
	t.Cleanup(func() { cancel(); <-done })
}

// waitArchived waits until asynq has archived the task of job id.
func waitArchived(t *testing.T, insp *asynq.Inspector, queue, id string) *asynq.TaskInfo {
	t.Helper()
	var info *asynq.TaskInfo
	testenv.Eventually(t, 10*time.Second, func() bool {
		var err error
		info, err = insp.GetTaskInfo(queue, id)
		return err == nil && info.State == asynq.TaskStateArchived
	}, "task %s was never archived", id)
	return info
}

func TestMalformedPayloadDiesAtOnce(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	insp := inspector(t, b)
	var runs atomic.Int32
	var dead deadEvents
	mux := tasks.NewMux()
	tasks.Handle(mux, receipt, func(ctx context.Context, o order) error { runs.Add(1); return nil })

	payloads := map[string]string{
		"wrong type": `{"order_id": 5}`,
		"not JSON":   `order 5, please`,
	}
	ids := map[string]string{}
	for name, p := range payloads {
		res, err := b.client.Enqueue(ctx, tasks.NewRaw(receipt.Name(), []byte(p), "malformed:"+name))
		require.NoError(t, err)
		ids[name] = res.Job.ID
	}
	b.startWorker(t, mux, onDead(&dead))

	for name, id := range ids {
		j := b.waitStatus(t, id, idempotency.StatusDead, 10*time.Second)
		require.Equal(t, 1, j.Attempts, name)
		require.Equal(t, string(retry.ClassPermanent), j.ErrorClass, name)
		require.Contains(t, j.LastError, "does not decode", name)
		require.Equal(t, payloads[name], j.PayloadSummary, name)
		require.NotNil(t, j.FinishedAt, name)

		info := waitArchived(t, insp, "default", id)
		require.Equal(t, 0, info.Retried, "%s: a payload that does not decode was retried", name)
		require.Contains(t, info.LastErr, "does not decode", name)

		evs := dead.of(id)
		require.Len(t, evs, 1, name)
		require.Equal(t, string(retry.ClassPermanent), evs[0].Class, name)
		require.Equal(t, 1, evs[0].Attempts, name)
	}
	require.EqualValues(t, 0, runs.Load(), "the handler ran on a payload that does not decode")
}

func TestTransientFailureDiesAfterBudgetWithFullContext(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	insp := inspector(t, b)
	var runs atomic.Int32
	var dead deadEvents
	mux := tasks.NewMux()
	tasks.Handle(mux, receipt, func(ctx context.Context, o order) error {
		n := runs.Add(1)
		return retry.Transient(fmt.Errorf("warehouse API timed out (run %d)", n))
	})
	res, err := b.client.Enqueue(ctx, receipt.New(order{OrderID: "flaky"}, tasks.MaxRetry(2), tasks.TraceID("trace-4711")))
	require.NoError(t, err)
	b.startWorker(t, mux, onDead(&dead))
	hurryRetries(t, b, "default")

	j := b.waitStatus(t, res.Job.ID, idempotency.StatusDead, 30*time.Second)
	require.EqualValues(t, 3, runs.Load())
	require.Equal(t, 3, j.Attempts)
	require.Equal(t, "warehouse API timed out (run 3)", j.LastError)
	require.Equal(t, string(retry.ClassTransient), j.ErrorClass)
	require.Equal(t, `{"order_id":"flaky"}`, j.PayloadSummary)
	require.NotNil(t, j.FinishedAt)
	require.Equal(t, "trace-4711", j.TraceID, "the trace id given at enqueue was lost when the job died")
	require.Equal(t, "order:flaky", j.BusinessKey)

	info := waitArchived(t, insp, "default", res.Job.ID)
	require.Equal(t, 2, info.Retried)
	require.Equal(t, []jobstore.DeadEvent{{
		JobID: res.Job.ID, Kind: receipt.Name(), Queue: "default", BusinessKey: "order:flaky",
		Class: string(retry.ClassTransient), Error: j.LastError, TraceID: "trace-4711", Attempts: 3,
	}}, dead.of(res.Job.ID))
}

func TestUnknownErrorGetsUnknownBudget(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	insp := inspector(t, b)
	var runs atomic.Int32
	mux := tasks.NewMux()
	tasks.Handle(mux, receipt, func(ctx context.Context, o order) error {
		runs.Add(1)
		return errors.New("something odd happened")
	})
	res, err := b.client.Enqueue(ctx, receipt.New(order{OrderID: "odd"}))
	require.NoError(t, err)
	b.startWorker(t, mux, func(c *server.Config) { c.Retry.UnknownMaxRetry = 1 })
	hurryRetries(t, b, "default")

	j := b.waitStatus(t, res.Job.ID, idempotency.StatusDead, 20*time.Second)
	require.Equal(t, 2, j.Attempts, "one try and UnknownMaxRetry (1) retry")
	require.Equal(t, string(retry.ClassUnknown), j.ErrorClass)
	require.Equal(t, "something odd happened", j.LastError)
	info := waitArchived(t, insp, "default", res.Job.ID)
	require.Equal(t, 1, info.Retried)
	require.Equal(t, tasks.DefaultMaxRetry+jobstore.AsynqRetryHeadroom, info.MaxRetry, "the unknown budget, not the task's, ended it")
	require.EqualValues(t, 2, runs.Load())
}

func TestWaitDoesNotUseAttempts(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	var runs, maxRetried atomic.Int32
	var attemptsSeen sync.Map // run → ledger attempt the handler saw
	mux := tasks.NewMux()
	tasks.Handle(mux, receipt, func(ctx context.Context, o order) error {
		n := runs.Add(1)
		attemptsSeen.Store(n, idempotency.Attempt(ctx))
		retried, _ := asynq.GetRetryCount(ctx)
		if int32(retried) > maxRetried.Load() {
			maxRetried.Store(int32(retried))
		}
		if n <= 2 {
			return retry.Wait(time.Second, errors.New("rate limited by the mail provider"))
		}
		return nil
	})
	// A budget of one retry: two counted waits would have spent it.
	res, err := b.client.Enqueue(ctx, receipt.New(order{OrderID: "wait"}, tasks.MaxRetry(1)))
	require.NoError(t, err)
	b.startWorker(t, mux, nil)
	hurryRetries(t, b, "default")

	j := b.waitStatus(t, res.Job.ID, idempotency.StatusSucceeded, 10*time.Second)
	require.EqualValues(t, 3, runs.Load())
	require.Equal(t, 1, j.Attempts, "two waits and a success are one attempt")
	for run := int32(1); run <= 3; run++ {
		a, _ := attemptsSeen.Load(run)
		require.Equal(t, 1, a, "run %d: a wait counted as an attempt", run)
	}
	require.EqualValues(t, 0, maxRetried.Load(), "asynq counted a wait as a retry")
}

func TestReplayRunsDeadJobOnceWithFreshBudget(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	insp := inspector(t, b)
	var fixed atomic.Bool
	var runs, lastRetried atomic.Int32
	mux := tasks.NewMux()
	tasks.Handle(mux, receipt, func(ctx context.Context, o order) error {
		runs.Add(1)
		retried, _ := asynq.GetRetryCount(ctx)
		lastRetried.Store(int32(retried))
		if !fixed.Load() {
			return retry.Transient(errors.New("inventory service down"))
		}
		return nil
	})
	res, err := b.client.Enqueue(ctx, receipt.New(order{OrderID: "replay"}, tasks.MaxRetry(1)))
	require.NoError(t, err)
	id := res.Job.ID
	b.startWorker(t, mux, nil)
	hurryRetries(t, b, "default")

	dead := b.waitStatus(t, id, idempotency.StatusDead, 20*time.Second)
	require.Equal(t, 2, dead.Attempts)
	require.Equal(t, 1, waitArchived(t, insp, "default", id).Retried)
	require.EqualValues(t, 2, runs.Load())

	_, err = testworker.Ops(t, b.store, insp).Replay(ctx, id, " ", "no actor")
	require.ErrorIs(t, err, inspect.ErrActorRequired)

	fixed.Store(true)
	rr, err := testworker.Ops(t, b.store, insp).Replay(ctx, id, "alice", "inventory service is back")
	require.NoError(t, err)
	require.False(t, rr.AlreadyReplayed)
	// Replay reads the job back after publishing it: the worker may have
	// started its new run by then.
	if rr.Job.Status == idempotency.StatusPending {
		require.Equal(t, 0, rr.Job.Attempts, "replay must reset the attempts")
	} else {
		require.Contains(t, []idempotency.Status{idempotency.StatusRunning, idempotency.StatusSucceeded}, rr.Job.Status)
		require.Equal(t, 1, rr.Job.Attempts, "replay must reset the attempts")
	}
	// The spent archive entry is gone; whatever asynq holds now is the new,
	// unretried task.
	if info, err := insp.GetTaskInfo("default", id); err == nil {
		require.NotEqual(t, asynq.TaskStateArchived, info.State)
		require.Equal(t, 0, info.Retried)
	} else {
		require.ErrorIs(t, err, asynq.ErrTaskNotFound)
	}

	again, err := testworker.Ops(t, b.store, insp).Replay(ctx, id, "bob", "double click")
	require.NoError(t, err)
	require.True(t, again.AlreadyReplayed)

	j := b.waitStatus(t, id, idempotency.StatusSucceeded, 10*time.Second)
	require.Equal(t, 1, j.Attempts)
	require.EqualValues(t, 0, lastRetried.Load(), "the replayed task kept its spent retry count")
	testenv.WaitAsynqIdle(t, b.redis, 10*time.Second, "critical", "default", "low")
	require.EqualValues(t, 3, runs.Load(), "a replay must run the handler exactly once more")

	entries, err := testworker.Ops(t, b.store, nil).Audit(ctx, id)
	require.NoError(t, err)
	require.Len(t, entries, 1, "only the replay that did something is audited")
	require.Equal(t, "replay", entries[0].Action)
	require.Equal(t, "alice", entries[0].Actor)
	require.Equal(t, "inventory service is back", entries[0].Note)
}

func TestReplayWithStepInDoubtNeedsResolution(t *testing.T) {
	for _, happened := range []bool{true, false} {
		t.Run(fmt.Sprintf("happened=%v", happened), func(t *testing.T) {
			b := setup(t)
			ctx := context.Background()
			insp := inspector(t, b)
			var calls atomic.Int32
			mux := tasks.NewMux()
			tasks.Handle(mux, receipt, func(ctx context.Context, o order) error {
				return idempotency.Step(ctx, "mail", func(ctx context.Context, key string) error {
					calls.Add(1)
					return nil
				})
			})
			res, err := b.client.Enqueue(ctx, receipt.New(order{OrderID: "doubt"}))
			require.NoError(t, err)
			id := res.Job.ID
			startedStep(t, b.pool, id, "mail") // the worker died mid-call
			b.startWorker(t, mux, nil)
			b.waitStatus(t, id, idempotency.StatusDead, 10*time.Second)
			waitArchived(t, insp, "default", id)

			_, err = testworker.Ops(t, b.store, insp).Replay(ctx, id, "alice", "try again")
			require.ErrorIs(t, err, inspect.ErrStepsInDoubt)
			require.ErrorContains(t, err, "mail")
			j, err := b.store.Get(ctx, id)
			require.NoError(t, err)
			require.Equal(t, idempotency.StatusDead, j.Status, "a refused replay changed the job")

			require.ErrorIs(t, testworker.Ops(t, b.store, nil).ResolveStep(ctx, id, "mail", happened, "", "x"), inspect.ErrActorRequired)
			require.ErrorIs(t, testworker.Ops(t, b.store, nil).ResolveStep(ctx, id, "sms", happened, "alice", "x"), idempotency.ErrNotFound)
			require.NoError(t, testworker.Ops(t, b.store, nil).ResolveStep(ctx, id, "mail", happened, "alice", "checked the provider's log"))
			_, err = testworker.Ops(t, b.store, insp).Replay(ctx, id, "alice", "step resolved")
			require.NoError(t, err)

			b.waitStatus(t, id, idempotency.StatusSucceeded, 10*time.Second)
			if happened {
				require.EqualValues(t, 0, calls.Load(), "a step a person said happened was called again")
			} else {
				require.EqualValues(t, 1, calls.Load(), "a step a person said did not happen must be called once")
			}
			steps, err := b.store.Steps(ctx, id)
			require.NoError(t, err)
			require.Len(t, steps, 1)
			require.Equal(t, "done", steps[0].Status)

			entries, err := testworker.Ops(t, b.store, nil).Audit(ctx, id)
			require.NoError(t, err)
			var actions []string
			for _, e := range entries {
				actions = append(actions, e.Action)
			}
			verdict := "step-not-happened:mail"
			if happened {
				verdict = "step-happened:mail"
			}
			require.Equal(t, []string{verdict, "replay"}, actions)
		})
	}
}

func TestDiscardClosesJobForGood(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	insp := inspector(t, b)
	var runs atomic.Int32
	mux := tasks.NewMux()
	tasks.Handle(mux, receipt, func(ctx context.Context, o order) error {
		runs.Add(1)
		return retry.Permanent(errors.New("customer account closed"))
	})
	res, err := b.client.Enqueue(ctx, receipt.New(order{OrderID: "discard"}))
	require.NoError(t, err)
	id := res.Job.ID
	var signals *executor.TestSignals
	b.startWorker(t, mux, func(c *server.Config) { signals = executor.InitTestSignals(&c.Guard) })
	b.waitStatus(t, id, idempotency.StatusDead, 10*time.Second)
	waitArchived(t, insp, "default", id)

	_, err = testworker.Ops(t, b.store, insp).Discard(ctx, id, "carol", " ")
	require.ErrorIs(t, err, inspect.ErrNoteRequired)
	_, err = testworker.Ops(t, b.store, insp).Discard(ctx, id, "", "closed account")
	require.ErrorIs(t, err, inspect.ErrActorRequired)

	const note = "account closed; refunded by hand"
	dr, err := testworker.Ops(t, b.store, insp).Discard(ctx, id, "carol", note)
	require.NoError(t, err)
	require.False(t, dr.AlreadyDiscarded)
	j := dr.Job
	require.Equal(t, idempotency.StatusDiscarded, j.Status)
	require.Equal(t, note, j.ResolutionNote)
	require.Equal(t, "carol", j.ResolvedBy)
	require.NotNil(t, j.FinishedAt)
	_, err = insp.GetTaskInfo("default", id)
	require.ErrorIs(t, err, asynq.ErrTaskNotFound, "the archived copy should be gone")

	// A stale copy of the task turns up later: acknowledged, not run.
	signals.Skipped.RequireEmpty(t)
	ac := asynq.NewClient(b.redis)
	defer ac.Close()
	_, err = ac.Enqueue(asynq.NewTask(j.Kind, j.Payload), asynq.TaskID(id), asynq.Queue(j.Queue))
	require.NoError(t, err)
	require.Equal(t, id, signals.Skipped.Wait(t), "the stale copy was never delivered")
	require.EqualValues(t, 1, runs.Load(), "a discarded job ran again")
	testenv.Eventually(t, 10*time.Second, func() bool {
		_, err := insp.GetTaskInfo("default", id)
		return errors.Is(err, asynq.ErrTaskNotFound)
	}, "the stale delivery should be acknowledged")

	dr, err = testworker.Ops(t, b.store, insp).Discard(ctx, id, "dave", "me too")
	require.NoError(t, err, "discarding twice is a no-op")
	require.True(t, dr.AlreadyDiscarded)
	again := dr.Job
	require.Equal(t, idempotency.StatusDiscarded, again.Status)
	require.Equal(t, note, again.ResolutionNote)
	require.Equal(t, "carol", again.ResolvedBy)
	entries, err := testworker.Ops(t, b.store, nil).Audit(ctx, id)
	require.NoError(t, err)
	require.Len(t, entries, 1)
	require.Equal(t, "discard", entries[0].Action)
	require.Equal(t, "carol", entries[0].Actor)
	require.Equal(t, note, entries[0].Note)

	_, err = testworker.Ops(t, b.store, insp).Replay(ctx, id, "dave", "undo")
	require.ErrorIs(t, err, inspect.ErrNotDead)
}

func TestDeadJobOutlivesAsynqArchive(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	insp := inspector(t, b)
	var fixed atomic.Bool
	var runs atomic.Int32
	mux := tasks.NewMux()
	tasks.Handle(mux, charge, func(ctx context.Context, o order) error {
		runs.Add(1)
		if !fixed.Load() {
			return retry.Permanent(errors.New("card declined"))
		}
		return nil
	})
	res, err := b.client.Enqueue(ctx, charge.New(order{OrderID: "archive"}))
	require.NoError(t, err)
	id := res.Job.ID
	b.startWorker(t, mux, nil)
	b.waitStatus(t, id, idempotency.StatusDead, 10*time.Second)

	// What asynq's archive trimming (10,000 tasks or 90 days) does.
	waitArchived(t, insp, "critical", id)
	require.NoError(t, insp.DeleteTask("critical", id))
	_, err = insp.GetTaskInfo("critical", id)
	require.ErrorIs(t, err, asynq.ErrTaskNotFound)

	n, err := testworker.Ops(t, b.store, nil).Count(ctx, inspect.Filter{Kind: charge.Name()})
	require.NoError(t, err)
	require.Equal(t, 1, n)
	list, err := testworker.Ops(t, b.store, nil).List(ctx, inspect.Filter{Queue: "critical"}, 10, 0)
	require.NoError(t, err)
	require.Len(t, list, 1)
	require.Equal(t, id, list[0].ID)
	require.Equal(t, "card declined", list[0].LastError)
	require.Equal(t, `{"order_id":"archive"}`, list[0].PayloadSummary)

	fixed.Store(true)
	_, err = testworker.Ops(t, b.store, insp).Replay(ctx, id, "erin", "card updated")
	require.NoError(t, err)
	j := b.waitStatus(t, id, idempotency.StatusSucceeded, 10*time.Second)
	require.Equal(t, 1, j.Attempts)
	require.EqualValues(t, 2, runs.Load())
}

func TestBulkActionsNeedTheConfirmedCount(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	insp := inspector(t, b)
	var fixed atomic.Bool
	fail := func(ctx context.Context, o order) error {
		switch {
		case fixed.Load():
			return nil
		case o.OrderID == "odd":
			return errors.New("something odd happened")
		}
		return retry.Permanent(errors.New("order was cancelled"))
	}
	mux := tasks.NewMux()
	tasks.Handle(mux, receipt, fail)
	tasks.Handle(mux, charge, fail)
	ids := map[string]string{}
	for _, t1 := range []*tasks.Task{
		receipt.New(order{OrderID: "p1"}),
		receipt.New(order{OrderID: "p2"}),
		receipt.New(order{OrderID: "odd"}),
		charge.New(order{OrderID: "p3"}),
	} {
		res, err := b.client.Enqueue(ctx, t1)
		require.NoError(t, err)
		ids[t1.Kind()+"/"+t1.BusinessKey()] = res.Job.ID
	}
	p1, p2, odd, p3 := ids["test:receipt/order:p1"], ids["test:receipt/order:p2"], ids["test:receipt/order:odd"], ids["test:charge/p3"]
	b.startWorker(t, mux, func(c *server.Config) { c.Retry.UnknownMaxRetry = retry.Disabled })
	for _, id := range ids {
		j := b.waitStatus(t, id, idempotency.StatusDead, 10*time.Second)
		waitArchived(t, insp, j.Queue, id) // asynq archives it just after the ledger says dead
	}
	status := func(id string) idempotency.Status {
		j, err := b.store.Get(ctx, id)
		require.NoError(t, err)
		return j.Status
	}

	permanentReceipts := inspect.Filter{Kind: receipt.Name(), Class: string(retry.ClassPermanent)}
	n, err := testworker.Ops(t, b.store, nil).Count(ctx, permanentReceipts)
	require.NoError(t, err)
	require.Equal(t, 2, n)

	res, err := testworker.Ops(t, b.store, insp).DiscardMatching(ctx, permanentReceipts, 3, "dave", "bad import")
	require.ErrorIs(t, err, inspect.ErrCountChanged)
	require.Equal(t, 2, res.Matched)
	require.Zero(t, res.Done)
	_, err = testworker.Ops(t, b.store, insp).DiscardMatching(ctx, permanentReceipts, 2, "dave", "")
	require.ErrorIs(t, err, inspect.ErrNoteRequired)
	_, err = testworker.Ops(t, b.store, insp).DiscardMatching(ctx, permanentReceipts, 2, "", "bad import")
	require.ErrorIs(t, err, inspect.ErrActorRequired)
	all, err := testworker.Ops(t, b.store, nil).Count(ctx, inspect.Filter{})
	require.NoError(t, err)
	require.Equal(t, 4, all, "a refused bulk action changed something")
	require.Zero(t, b.count(t, `SELECT count(*) FROM keel_audit`))

	res, err = testworker.Ops(t, b.store, insp).DiscardMatching(ctx, permanentReceipts, 2, "dave", "bad import")
	require.NoError(t, err)
	require.Equal(t, inspect.BulkResult{Matched: 2, Done: 2, Unchanged: map[string]string{}, Failed: map[string]error{}}, res)
	require.Equal(t, idempotency.StatusDiscarded, status(p1))
	require.Equal(t, idempotency.StatusDiscarded, status(p2))
	require.Equal(t, idempotency.StatusDead, status(odd))
	require.Equal(t, idempotency.StatusDead, status(p3))

	unknown := inspect.Filter{Class: string(retry.ClassUnknown)}
	_, err = testworker.Ops(t, b.store, insp).ReplayMatching(ctx, unknown, 2, "dave", "fixed")
	require.ErrorIs(t, err, inspect.ErrCountChanged)
	require.Equal(t, idempotency.StatusDead, status(odd))

	fixed.Store(true)
	res, err = testworker.Ops(t, b.store, insp).ReplayMatching(ctx, unknown, 1, "dave", "odd error fixed in v1.2.3")
	require.NoError(t, err)
	require.Equal(t, 1, res.Done)
	b.waitStatus(t, odd, idempotency.StatusSucceeded, 10*time.Second)
	require.Equal(t, idempotency.StatusDead, status(p3), "a job outside the filter was replayed")
	require.Equal(t, idempotency.StatusDiscarded, status(p1), "a discarded job ran again")
	require.Equal(t, 3, b.count(t, `SELECT count(*) FROM keel_audit WHERE actor = 'dave'`))
}

// The count of dead jobs a bulk replay would refuse, which its confirm page
// shows, agrees with Replay's own verdict on each job: superseded, effects
// committed (recorded, or converted from an older keel's row), a step in doubt
// no Verify can settle — and not a step its handler can Verify.
func TestCountUnreplayableAgreesWithReplay(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	dead := func(key, extra string, args ...any) string {
		res, err := b.client.Enqueue(ctx, receipt.New(order{OrderID: key}))
		require.NoError(t, err)
		_, err = b.pool.Exec(ctx, `UPDATE keel_jobs SET status = 'dead', error_class = 'permanent', last_error = 'boom',
			finished_at = now() WHERE id = $1`, res.Job.ID)
		require.NoError(t, err)
		if extra != "" {
			_, err = b.pool.Exec(ctx, extra, append([]any{res.Job.ID}, args...)...)
			require.NoError(t, err)
		}
		return res.Job.ID
	}
	ids := []string{
		dead("plain", ""),
		dead("superseded", `UPDATE keel_jobs SET superseded_at = now(), business_key = business_key || '#' || id WHERE id = $1`),
		dead("effects", `UPDATE keel_jobs SET effects_committed_at = now() WHERE id = $1`),
		dead("effects-old", `UPDATE keel_jobs SET last_error = $2 WHERE id = $1`,
			"keel: handler failed after its completing InTx committed (its local effects are in): boom"),
		dead("doubt", `INSERT INTO keel_steps (job_id, name, status) VALUES ($1, 'mail', 'started')`),
		dead("verifiable", `INSERT INTO keel_steps (job_id, name, status, verifiable) VALUES ($1, 'mail', 'started', true)`),
		dead("done-step", `INSERT INTO keel_steps (job_id, name, status) VALUES ($1, 'mail', 'done')`),
	}
	testenv.ReapplyMigration(t, b.pool, "effects_as_data") // the effects-old row is an older keel's
	refused := 0
	for _, id := range ids {
		if _, err := checkReplay(t, b.store, id); err != nil {
			refused++
		}
	}
	require.Equal(t, 4, refused, "superseded, effects, effects-old, doubt")
	n, err := countUnreplayable(t, b.store, inspect.Filter{Kind: receipt.Name()})
	require.NoError(t, err)
	require.Equal(t, refused, n)
}

// A job retired while asynq still holds its task as running (the worker
// that ran it died, and asynq's lease on the task has not lapsed) cannot be
// replayed yet: the replay says so, and when to try again, instead of
// passing on asynq's "use CancelProcessing", and changes nothing.
func TestReplayOfAJobAsynqHoldsAsRunningSaysToWait(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	insp := inspector(t, b)
	res, err := b.client.Enqueue(ctx, receipt.New(order{OrderID: "held"}))
	require.NoError(t, err)
	rdb := redis.NewClient(&redis.Options{Addr: b.redis.Addr, DB: b.redis.DB})
	t.Cleanup(func() { rdb.Close() })
	require.NoError(t, testworker.AsynqFetch(ctx, rdb, "default", time.Now().Add(30*time.Second)))
	info, err := insp.GetTaskInfo("default", res.Job.ID)
	require.NoError(t, err)
	require.Equal(t, asynq.TaskStateActive, info.State)
	_, err = b.pool.Exec(ctx, `UPDATE keel_jobs SET status = 'dead', attempts = 3, error_class = 'crashed', finished_at = now() WHERE id = $1`, res.Job.ID)
	require.NoError(t, err)

	_, err = testworker.Ops(t, b.store, insp).Replay(ctx, res.Job.ID, "alice", "")
	require.ErrorIs(t, err, inspect.ErrTaskActive)
	require.NotContains(t, err.Error(), "CancelProcessing")
	require.Contains(t, err.Error(), "again")
	j, err := b.store.Get(ctx, res.Job.ID)
	require.NoError(t, err)
	require.Equal(t, idempotency.StatusDead, j.Status)
	entries, err := testworker.Ops(t, b.store, nil).Audit(ctx, res.Job.ID)
	require.NoError(t, err)
	require.Empty(t, entries)
}

// A replay made the moment a job dies, while its worker still records the
// death (its alert, then its row's alert paid) and holds asynq's task: the
// replay waits for asynq to let the task go without holding the job's row,
// which the worker writes before it lets the task go. It waited holding
// the row, each for the other, until its grace ran out and it refused.
func TestAReplayAsTheJobDiesDoesNotWaitForItself(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	died, resume := make(chan struct{}), make(chan struct{})
	var once sync.Once
	mux := tasks.NewMux()
	var runs atomic.Int32
	tasks.Handle(mux, receipt, func(ctx context.Context, o order) error {
		if runs.Add(1) == 1 {
			return retry.Permanent(errors.New("the warehouse refused"))
		}
		return nil
	})
	b.startWorker(t, mux, func(c *server.Config) {
		c.DisableReconciler = true // the worker alone pays the death's alert
		c.Guard.OnDead = func(ctx context.Context, e idempotency.DeadEvent) {
			once.Do(func() { close(died) })
			<-resume
		}
	})
	res, err := b.client.Enqueue(ctx, receipt.New(order{OrderID: "replayed-as-it-dies"}))
	require.NoError(t, err)
	<-died // dead in the ledger; the worker holds asynq's task
	replayed := make(chan error, 1)
	go func() {
		_, err := testworker.Ops(t, b.store, inspector(t, b)).Replay(ctx, res.Job.ID, "alice", "")
		replayed <- err
	}()
	// Let the worker go on once the replay holds the job's row (an old
	// replay took it at once), or after a while without it (one that waits
	// for asynq without it).
	rowLocked := func() bool {
		tx, err := b.pool.Begin(ctx)
		require.NoError(t, err)
		defer tx.Rollback(ctx) //nolint:errcheck
		_, err = tx.Exec(ctx, `SELECT 1 FROM keel_jobs WHERE id = $1 FOR UPDATE NOWAIT`, res.Job.ID)
		return err != nil
	}
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for window := time.After(2 * time.Second); !rowLocked(); {
		select {
		case <-tick.C:
			continue
		case <-window:
		}
		break
	}
	close(resume)
	require.NoError(t, <-replayed)
	b.waitStatus(t, res.Job.ID, idempotency.StatusSucceeded, 20*time.Second)
	require.EqualValues(t, 2, runs.Load())
}
