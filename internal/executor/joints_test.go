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
	"github.com/keeljobs/keel/internal/executor"
	"github.com/keeljobs/keel/internal/jobstore"
	"github.com/keeljobs/keel/internal/testenv"
	"github.com/keeljobs/keel/internal/testworker"
	"github.com/keeljobs/keel/retry"
	"github.com/keeljobs/keel/server"
	"github.com/keeljobs/keel/tasks"
)

// Where two of keel's mechanisms meet: the completing InTx and a deploy,
// the completing InTx and the timeout watchdog, asynq's retry count and the
// ledger's budget.

var (
	committedThenCut  = tasks.Define[order]("joint:committed_then_cut", tasks.MaxRetry(0), tasks.Key(func(o order) string { return o.OrderID }))
	committedThenHung = tasks.Define[order]("joint:committed_then_hung", tasks.MaxRetry(0), tasks.Timeout(time.Second),
		tasks.Key(func(o order) string { return o.OrderID }))
	cancelledOften = tasks.Define[order]("joint:cancelled_often", tasks.MaxRetry(2), tasks.Key(func(o order) string { return o.OrderID }))
)

// deathLog records the deaths a worker reports.
type deathLog struct{ n atomic.Int32 }

func (d *deathLog) onDead(context.Context, jobstore.DeadEvent) { d.n.Add(1) }

// A deploy whose shutdown cancels handlers after their completing InTx
// committed, handlers that then return the context's error: the jobs
// succeeded. No dead letter, no alert.
func TestADeployAfterTheCompletingInTxIsASuccess(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	committed := make(chan string, 3)
	mux := tasks.NewMux()
	tasks.Handle(mux, committedThenCut, func(ctx context.Context, o order) error {
		if err := idempotency.InTx(ctx, func(tx pgx.Tx) error {
			id, _ := idempotency.JobID(ctx)
			_, err := tx.Exec(ctx, `INSERT INTO effects (job_id, name) VALUES ($1, 'local')`, id)
			return err
		}); err != nil {
			return err
		}
		committed <- o.OrderID
		<-ctx.Done() // a call to a cache, a log flush: whatever comes after
		return fmt.Errorf("after the commit: %w", ctx.Err())
	})
	var deaths deathLog
	cfg := server.Config{Redis: b.redis, Pool: b.pool, Concurrency: 5, ShutdownTimeout: 200 * time.Millisecond}
	cfg.Relay.PollInterval = 100 * time.Millisecond
	cfg.Guard.OnDead = deaths.onDead
	srv, err := server.New(cfg, mux)
	require.NoError(t, err)
	runCtx, deploy := context.WithCancel(ctx)
	stopped := make(chan error, 1)
	go func() { stopped <- srv.Run(runCtx) }()

	var ids []string
	for i := range 3 {
		res, err := b.client.Enqueue(ctx, committedThenCut.New(order{OrderID: fmt.Sprintf("cut-%d", i)}))
		require.NoError(t, err)
		ids = append(ids, res.Job.ID)
	}
	for range ids {
		<-committed
	}
	deploy()
	require.NoError(t, <-stopped)
	for _, id := range ids {
		j, err := b.store.Get(ctx, id)
		require.NoError(t, err)
		require.Equal(t, idempotency.StatusSucceeded, j.Status, "a deploy after the completing InTx made %+v", j)
	}
	require.Zero(t, deaths.n.Load(), "a deploy raised an alert")
}

// A handler whose completing InTx committed and which then fails is a dead
// letter however late it returns: hung past its deadline and grace, then
// failing, it is recorded as it would be before.
func TestAFailureAfterTheCompletingInTxIsRecordedHoweverLate(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	release := make(chan struct{})
	mux := tasks.NewMux()
	tasks.Handle(mux, committedThenHung, func(ctx context.Context, o order) error {
		if err := idempotency.InTx(ctx, func(tx pgx.Tx) error { return nil }); err != nil {
			return err
		}
		<-release // ignores its context, past deadline and grace
		return errors.New("the cache refresh after the commit failed")
	})
	var deaths deathLog
	var signals *executor.TestSignals
	srv := b.startWorker(t, mux, func(c *server.Config) {
		c.Guard.TimeoutGrace = 200 * time.Millisecond
		c.Guard.OnDead = deaths.onDead
		signals = executor.InitTestSignals(&c.Guard)
	})
	res, err := b.client.Enqueue(ctx, committedThenHung.New(order{OrderID: "hung-after-commit"}))
	require.NoError(t, err)
	b.waitStatus(t, res.Job.ID, idempotency.StatusSucceeded, 10*time.Second)
	require.Equal(t, res.Job.ID, signals.Overran.Wait(t), "the watchdog never saw the run outlive its deadline")
	require.EqualValues(t, 1, srv.GuardStats().Overran)
	close(release)
	j := b.waitStatus(t, res.Job.ID, idempotency.StatusDead, 10*time.Second)
	require.Contains(t, j.LastError, "the cache refresh after the commit failed")
	require.NotNil(t, j.EffectsCommittedAt)
	testenv.Eventually(t, 5*time.Second, func() bool { return deaths.n.Load() == 1 }, "no alert for the dead letter")
}

// Runs asynq cut short and keel released uncharged (Inspector.
// CancelProcessing, as the README says) do not count towards asynq's retry
// limit either: a MaxRetry(2) job cancelled six times mid-run (asynq's own
// limit is the ledger's plus AsynqRetryHeadroom) still has both retries
// when its first real attempts fail, and succeeds on its third.
func TestAsynqsCountDoesNotRetireAJobTheLedgerWouldRun(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	var runs atomic.Int32
	started := make(chan int32, 16)
	mux := tasks.NewMux()
	tasks.Handle(mux, cancelledOften, func(ctx context.Context, o order) error {
		n := runs.Add(1)
		started <- n
		switch {
		case n <= 6:
			<-ctx.Done()
			return ctx.Err()
		case n <= 8:
			return errors.New("the provider failed")
		}
		return nil
	})
	var deaths deathLog
	b.startWorker(t, mux, func(c *server.Config) { c.Guard.OnDead = deaths.onDead })
	insp := asynq.NewInspector(b.redis)
	defer insp.Close()
	res, err := b.client.Enqueue(ctx, cancelledOften.New(order{OrderID: "cancelled-often"}))
	require.NoError(t, err)
	for range 6 {
		<-started
		require.NoError(t, insp.CancelProcessing(res.Job.ID))
	}
	j := b.waitStatus(t, res.Job.ID, idempotency.StatusSucceeded, 30*time.Second)
	require.Equal(t, 3, j.Attempts, "the ledger counts the failures and the success, not the cancels")
	require.EqualValues(t, 9, runs.Load())
	require.Zero(t, deaths.n.Load())
}

var (
	dueBy   = tasks.Define[order]("joint:due_by", tasks.MaxRetry(3), tasks.Key(func(o order) string { return o.OrderID }))
	staleBy = tasks.Define[order]("joint:stale_by", tasks.MaxRetry(3), tasks.ExpireAtDeadline(),
		tasks.Key(func(o order) string { return o.OrderID }))
)

// An enqueue whose run time is not before the job's deadline is refused:
// such a job could never run.
func TestARunTimePastTheDeadlineIsRefused(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	by := tasks.Deadline(time.Now().Add(time.Minute))
	for _, opt := range []tasks.Option{tasks.Delay(2 * time.Minute), tasks.ProcessAt(time.Now().Add(time.Hour))} {
		_, err := b.client.Enqueue(ctx, dueBy.New(order{OrderID: "too-late"}, by, opt))
		require.ErrorIs(t, err, idempotency.ErrPastDeadline)
		require.ErrorIs(t, err, tasks.ErrInvalidTask)
	}
	_, err := b.client.Enqueue(ctx, dueBy.New(order{OrderID: "gone"}, tasks.Deadline(time.Now().Add(-time.Second))))
	require.ErrorIs(t, err, idempotency.ErrPastDeadline)
	_, err = b.client.EnqueueMany(ctx, dueBy.New(order{OrderID: "ok"}, by), dueBy.New(order{OrderID: "late"}, by, tasks.Delay(time.Hour)))
	require.ErrorIs(t, err, idempotency.ErrPastDeadline)
	require.Zero(t, b.count(t, `SELECT count(*) FROM keel_jobs`), "a refused enqueue wrote a job")
}

// A job whose deadline passes while it waits for a worker never runs, and
// ends: asynq fails such a delivery before any middleware runs, and the
// ledger records it — dead with class deadline, alerted and counted by its
// batch, or, for a kind that drops stale work, discarded as expired with
// no alert.
func TestAJobWhoseDeadlinePassedBeforeItRanEnds(t *testing.T) {
	b := setup(t)
	batchTables(t, b)
	ctx := context.Background()
	deadline := time.Now().Add(2 * time.Second)
	batch, err := b.client.NewBatch(ctx, tasks.BatchSpec{Description: "deadline", OnComplete: tasks.BatchCallback(batchCB, nil)})
	require.NoError(t, err)
	dead, err := b.client.Enqueue(ctx, dueBy.New(order{OrderID: "waited-too-long"}, tasks.InBatch(batch.ID), tasks.Deadline(deadline)))
	require.NoError(t, err)
	stale, err := b.client.Enqueue(ctx, staleBy.New(order{OrderID: "stale"}, tasks.InBatch(batch.ID), tasks.Deadline(deadline)))
	require.NoError(t, err)
	_, err = b.client.SealBatch(ctx, batch.ID)
	require.NoError(t, err)
	// The worker comes only after the deadline (a backlog, an outage). Real
	// time: asynq fails a delivery by the wall clock against the deadline
	// in its message.
	time.Sleep(time.Until(deadline))
	var runs atomic.Int32
	mux := tasks.NewMux()
	handle := func(ctx context.Context, o order) error { runs.Add(1); return nil }
	tasks.Handle(mux, dueBy, handle)
	tasks.Handle(mux, staleBy, handle)
	tasks.Handle(mux, batchCB, func(ctx context.Context, d tasks.BatchDone) error {
		return idempotency.InTx(ctx, func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `INSERT INTO callback_runs (batch_id, generation, event, counts, data)
				VALUES ($1, $2, $3, '{}', '')`, d.BatchID, d.Generation, d.Event)
			return err
		})
	})
	var deaths, expiries deathLog
	srv := b.startWorker(t, mux, func(c *server.Config) {
		c.Guard.OnDead = deaths.onDead
		c.Guard.OnExpired = expiries.onDead
	})

	j := b.waitStatus(t, dead.Job.ID, idempotency.StatusDead, 15*time.Second)
	require.Equal(t, "deadline", j.ErrorClass)
	require.Contains(t, j.LastError, "deadline")
	s := b.waitStatus(t, stale.Job.ID, idempotency.StatusDiscarded, 15*time.Second)
	require.Equal(t, "expired", s.ErrorClass)
	require.Equal(t, "keel", s.ResolvedBy)
	b.waitCallbackRuns(t, batch.ID, 1, 15*time.Second)
	require.Zero(t, runs.Load(), "a job ran past its deadline")
	testenv.Eventually(t, 5*time.Second, func() bool { return deaths.n.Load() == 1 }, "the dead one raised no alert, or the expired one did")
	require.EqualValues(t, 1, srv.GuardStats().Expired)
	require.EqualValues(t, 1, expiries.n.Load(), "the expiry was not reported (metrics count it)")
	_, err = testworker.Ops(t, b.store, nil).Replay(ctx, stale.Job.ID, "ops", "")
	require.Error(t, err, "an expired job was replayable")
	// A person who replays the dead one wants it run: its passed deadline
	// goes with the replay.
	insp := asynq.NewInspector(b.redis)
	defer insp.Close()
	_, err = testworker.Ops(t, b.store, insp).Replay(ctx, dead.Job.ID, "ops", "the partner is back")
	require.NoError(t, err)
	j = b.waitStatus(t, dead.Job.ID, idempotency.StatusSucceeded, 15*time.Second)
	require.Nil(t, j.Deadline)
	require.EqualValues(t, 1, runs.Load())
}

// A retry that would come after the job's deadline is not scheduled for
// asynq to fail unrun: the job ends at once.
func TestARetryPastTheDeadlineEndsTheJob(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	deadline := time.Now().Add(20 * time.Second)
	var runs atomic.Int32
	mux := tasks.NewMux()
	tasks.Handle(mux, dueBy, func(ctx context.Context, o order) error {
		runs.Add(1)
		return retry.After(time.Minute, errors.New("the provider is down for a minute"))
	})
	var deaths deathLog
	b.startWorker(t, mux, func(c *server.Config) { c.Guard.OnDead = deaths.onDead })
	res, err := b.client.Enqueue(ctx, dueBy.New(order{OrderID: "retry-too-late"}, tasks.Deadline(deadline)))
	require.NoError(t, err)
	j := b.waitStatus(t, res.Job.ID, idempotency.StatusDead, 15*time.Second)
	require.Equal(t, "deadline", j.ErrorClass)
	require.Contains(t, j.LastError, "the provider is down for a minute")
	require.EqualValues(t, 1, runs.Load())
	require.EqualValues(t, 1, deaths.n.Load())
}

var (
	slowCall = tasks.Define[order]("joint:slow_call", tasks.MaxRetry(3), tasks.Timeout(time.Second),
		tasks.Key(func(o order) string { return o.OrderID }))
	pausedCall = tasks.Define[order]("joint:paused_call", tasks.MaxRetry(0), tasks.Key(func(o order) string { return o.OrderID }))
)

// A step's call that ignores its context and outlives its run (given up at
// its timeout) is not made a second time: the next attempt waits, without
// spending an attempt, until the first call returned and its outcome is
// recorded — by the run that made it — and then skips the step. The remote
// counts every call it receives; it dedupes nothing.
func TestAStepCallThatOutlivesItsRunIsNotMadeTwice(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	var calls, received atomic.Int32
	release := make(chan struct{})
	mux := tasks.NewMux()
	tasks.Handle(mux, slowCall, func(ctx context.Context, o order) error {
		return idempotency.Step(ctx, "charge", func(ctx context.Context, key string) error {
			if calls.Add(1) == 1 {
				<-release // a client that ignores its context, still on its way
			}
			received.Add(1)
			return nil
		}, idempotency.Verify(func(ctx context.Context, key string) (bool, error) { return received.Load() > 0, nil }))
	})
	b.startWorker(t, mux, func(c *server.Config) {
		c.Guard.TimeoutGrace = 200 * time.Millisecond
		c.Guard.Lease = 2 * time.Second
	})
	// Attempts and waits come back at once rather than after their delays:
	// what is tested is what each one does, not when it comes.
	hurryRetries(t, b, "default")
	res, err := b.client.Enqueue(ctx, slowCall.New(order{OrderID: "slow-call"}))
	require.NoError(t, err)
	// The first run is given up at its timeout; the next one finds the
	// call in flight and waits.
	testenv.Eventually(t, 20*time.Second, func() bool {
		return b.count(t, `SELECT count(*) FROM keel_jobs WHERE id = $1 AND last_error LIKE '%may still be in flight%'`, res.Job.ID) == 1
	}, "no attempt waited for the call in flight")
	require.EqualValues(t, 0, received.Load())
	close(release)
	j := b.waitStatus(t, res.Job.ID, idempotency.StatusSucceeded, 20*time.Second)
	require.EqualValues(t, 1, received.Load(), "the call was made twice")
	require.EqualValues(t, 1, calls.Load())
	require.Equal(t, 2, j.Attempts, "the timed-out attempt and the one that skipped the step; the wait is no attempt")
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM keel_steps WHERE job_id = $1 AND status = 'done' AND call_until IS NULL`, res.Job.ID))
}

// A worker paused past its lease (a long GC pause, SIGSTOP, a frozen VM)
// that wakes up before anyone took its job over does not send a step's
// call: the run checks its lease has not run out just before the call.
func TestAStepCallIsNotSentByARunWhoseLeaseRanOut(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	var calls atomic.Int32
	paused, wake := make(chan string, 1), make(chan struct{})
	stepErr := make(chan error, 1)
	mux := tasks.NewMux()
	tasks.Handle(mux, pausedCall, func(ctx context.Context, o order) error {
		id, _ := idempotency.JobID(ctx)
		paused <- id
		<-wake
		err := idempotency.Step(ctx, "charge", func(ctx context.Context, key string) error { calls.Add(1); return nil })
		stepErr <- err
		return err
	})
	b.startWorker(t, mux, func(c *server.Config) { c.Guard.Lease = time.Minute })
	_, err := b.client.Enqueue(ctx, pausedCall.New(order{OrderID: "paused"}))
	require.NoError(t, err)
	id := <-paused
	// The pause outlasts the lease; nobody has taken the job yet.
	_, err = b.pool.Exec(ctx, `UPDATE keel_jobs SET lease_until = now() - interval '1 second' WHERE id = $1`, id)
	require.NoError(t, err)
	close(wake)
	require.ErrorIs(t, <-stepErr, idempotency.ErrLeaseLost)
	require.Zero(t, calls.Load(), "a run whose lease ran out sent the call")
}

var (
	keyedCancel  = tasks.Define[order]("joint:keyed_cancel", tasks.MaxRetry(0), tasks.Unique(time.Millisecond), tasks.Key(func(o order) string { return o.OrderID }))
	keyedTimeout = tasks.Define[order]("joint:keyed_timeout", tasks.MaxRetry(0), tasks.Unique(time.Millisecond), tasks.Timeout(time.Second),
		tasks.Key(func(o order) string { return o.OrderID }))
)

// keyOverlap counts the handlers of each key running at once and the most
// ever seen together.
type keyOverlap struct {
	mu      sync.Mutex
	running map[string]int
	most    int
}

func (k *keyOverlap) enter(key string) func() {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.running == nil {
		k.running = map[string]int{}
	}
	k.running[key]++
	k.most = max(k.most, k.running[key])
	return func() {
		k.mu.Lock()
		k.running[key]--
		k.mu.Unlock()
	}
}

// A kind's dedupe window never lets two runs of one key overlap: a newer
// job of a key whose older job was cancelled mid-run, or given up at its
// timeout, is accepted at once, but starts only when the older handler has
// returned — waiting without spending attempts.
func TestADedupeWindowNeverOverlapsTwoRunsOfAKey(t *testing.T) {
	for _, tc := range []struct {
		name string
		kind *tasks.Kind[order]
		end  func(t *testing.T, b *bundle, id string)
	}{
		{"cancelled", keyedCancel, func(t *testing.T, b *bundle, id string) {
			_, err := b.client.Cancel(context.Background(), id)
			require.NoError(t, err)
		}},
		{"timed out", keyedTimeout, func(t *testing.T, b *bundle, id string) {
			b.waitStatus(t, id, idempotency.StatusDead, 20*time.Second)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := setup(t)
			ctx := context.Background()
			var overlap keyOverlap
			var runs atomic.Int32
			started := make(chan struct{}, 2)
			release := make(chan struct{})
			mux := tasks.NewMux()
			tasks.Handle(mux, tc.kind, func(ctx context.Context, o order) error {
				defer overlap.enter(o.OrderID)()
				if runs.Add(1) == 1 {
					started <- struct{}{}
					<-release // ignores its context: still acting after keel let it go
				}
				return nil
			})
			var signals *executor.TestSignals
			b.startWorker(t, mux, func(c *server.Config) {
				c.Guard.TimeoutGrace = 200 * time.Millisecond
				signals = executor.InitTestSignals(&c.Guard)
			})
			first, err := b.client.Enqueue(ctx, tc.kind.New(order{OrderID: "k1"}))
			require.NoError(t, err)
			<-started
			tc.end(t, b, first.Job.ID)
			second, err := b.client.Enqueue(ctx, tc.kind.New(order{OrderID: "k1"}))
			require.NoError(t, err)
			require.False(t, second.Existed, "the window passed: a new job")
			require.NotEqual(t, first.Job.ID, second.Job.ID)
			// A delivery of the newer job found the key held: the guard
			// looked, and did not start it.
			signals.Busy.WaitFor(t, func(id string) bool { return id == second.Job.ID })
			require.EqualValues(t, 1, runs.Load(), "the newer job started beside the older handler")
			close(release)
			j := b.waitStatus(t, second.Job.ID, idempotency.StatusSucceeded, 20*time.Second)
			require.Equal(t, 1, j.Attempts, "waiting for the older handler spent an attempt")
			overlap.mu.Lock()
			defer overlap.mu.Unlock()
			require.Equal(t, 1, overlap.most, "two runs of one key overlapped")
		})
	}
}

var (
	crashedBefore = tasks.Define[order]("joint:crashed_before", tasks.MaxRetry(1), tasks.Timeout(10*time.Second),
		tasks.Key(func(o order) string { return o.OrderID }))
	busyLong = tasks.Define[order]("joint:busy_long", tasks.MaxRetry(3), tasks.Key(func(o order) string { return o.OrderID }))
)

// A job whose earlier run crashed runs its last run alone. On a worker that
// always has a long job running (a new one arrives before the last ends)
// that must not wait for an idle moment that never comes: handed back once
// because the others did not finish in time, the worker takes no new work
// until the run has come back and run.
func TestARunThatMustRunAloneGetsRoomOnAWorkerNeverIdle(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	var longRunning atomic.Int32
	mux := tasks.NewMux()
	tasks.Handle(mux, busyLong, func(ctx context.Context, o order) error {
		longRunning.Add(1)
		defer longRunning.Add(-1)
		select { // a long job: a report, an export
		case <-time.After(4 * time.Second):
		case <-ctx.Done():
			return ctx.Err()
		}
		return nil
	})
	var ran atomic.Int32
	tasks.Handle(mux, crashedBefore, func(ctx context.Context, o order) error {
		ran.Add(1)
		return nil
	})
	b.startWorker(t, mux, func(c *server.Config) { c.Concurrency = 3 })
	// The run handed back comes back at once: when is not what is tested.
	hurryRetries(t, b, "default")
	feed, fed := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(fed)
		tick := time.NewTicker(time.Second)
		defer tick.Stop()
		for i := 0; ; i++ {
			if _, err := b.client.Enqueue(ctx, busyLong.New(order{OrderID: fmt.Sprintf("long-%d", i)})); err != nil {
				t.Error(err)
				return
			}
			select {
			case <-feed:
				return
			case <-tick.C:
			}
		}
	}()
	defer func() { close(feed); <-fed }()
	testenv.Eventually(t, 10*time.Second, func() bool { return longRunning.Load() > 0 }, "the worker never got busy")
	// A job whose first run crashed its worker: its next run is its last,
	// and must run alone. It is published once the transaction that marks
	// that commits.
	var res *tasks.Result
	require.NoError(t, pgx.BeginFunc(ctx, b.pool, func(tx pgx.Tx) error {
		var err error
		if res, err = b.client.EnqueueTx(ctx, tx, crashedBefore.New(order{OrderID: "crashed-before"})); err != nil {
			return err
		}
		tag, err := tx.Exec(ctx, `UPDATE keel_jobs SET attempts = 1, crashes = 1 WHERE id = $1 AND status = 'pending'`, res.Job.ID)
		if err == nil && tag.RowsAffected() != 1 {
			err = fmt.Errorf("marked %d rows", tag.RowsAffected())
		}
		return err
	}))
	j := b.waitStatus(t, res.Job.ID, idempotency.StatusSucceeded, 40*time.Second)
	require.EqualValues(t, 1, ran.Load())
	require.Equal(t, 2, j.Attempts, "waiting for room spent an attempt")
}
