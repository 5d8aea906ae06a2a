package executor_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/inspect"
	"github.com/keeljobs/keel/internal/executor"
	"github.com/keeljobs/keel/internal/jobstore"
	"github.com/keeljobs/keel/internal/testenv"
	"github.com/keeljobs/keel/internal/testsignal"
	"github.com/keeljobs/keel/internal/testworker"
	"github.com/keeljobs/keel/migrate"
	"github.com/keeljobs/keel/retry"
	"github.com/keeljobs/keel/server"
	"github.com/keeljobs/keel/tasks"
)

type order struct {
	OrderID string `json:"order_id"`
}

var (
	receipt = tasks.Define[order]("test:receipt", tasks.Key(func(o order) string { return "order:" + o.OrderID }))
	charge  = tasks.Define[order]("test:charge", tasks.Queue("critical"), tasks.Key(func(o order) string { return o.OrderID }))
)

func TestMigrateTwiceIsNoOpAndNewerSchemaIsRefused(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	res, err := migrate.Up(ctx, b.pool)
	require.NoError(t, err)
	require.Empty(t, res.Applied, "second migrate must apply nothing")
	require.Equal(t, migrate.Version(), res.To)
	require.NoError(t, migrate.Check(ctx, b.pool))

	_, err = b.pool.Exec(ctx, `INSERT INTO keel_schema_migrations (version, name) VALUES (9999, '9999_future')`)
	require.NoError(t, err)
	_, err = migrate.Up(ctx, b.pool)
	require.ErrorIs(t, err, migrate.ErrSchemaTooNew)
	require.ErrorContains(t, err, "9999")
	require.ErrorIs(t, migrate.Check(ctx, b.pool), migrate.ErrSchemaTooNew)
}

func TestConcurrentDuplicateEnqueueYieldsOneRowAndOneRun(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	var runs atomic.Int32
	mux := tasks.NewMux()
	tasks.Handle(mux, receipt, func(ctx context.Context, o order) error {
		runs.Add(1)
		return nil
	})

	const n = 50
	var wg sync.WaitGroup
	results := make([]*tasks.Result, n)
	errs := make([]error, n)
	start := make(chan struct{})
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			results[i], errs[i] = b.client.Enqueue(ctx, receipt.New(order{OrderID: "123"}))
		}()
	}
	close(start)
	wg.Wait()
	created := 0
	for i := range n {
		require.NoError(t, errs[i])
		require.Equal(t, results[0].Job.ID, results[i].Job.ID, "every caller gets the same job")
		if !results[i].Existed {
			created++
		}
	}
	require.Equal(t, 1, created, "exactly one caller created the job")
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM keel_jobs WHERE kind = 'test:receipt'`))

	b.startWorker(t, mux, nil)
	b.waitStatus(t, results[0].Job.ID, idempotency.StatusSucceeded, 10*time.Second)
	// Enqueueing again after success still returns the finished job, no rerun.
	again, err := b.client.Enqueue(ctx, receipt.New(order{OrderID: "123"}))
	require.NoError(t, err)
	require.True(t, again.Existed)
	require.False(t, again.Published, "a finished job was published again")
	require.Equal(t, idempotency.StatusSucceeded, again.Job.Status)
	testenv.WaitAsynqIdle(t, b.redis, 10*time.Second, "critical", "default", "low")
	require.EqualValues(t, 1, runs.Load())
}

// Asynq task ids are unique per queue, so publishing one ledger job to two
// queues read by two workers is a real duplicate delivery. The second copy
// is delivered while the first one's handler runs, which waits until that
// copy has found the lease held: the two always overlap.
func TestConcurrentDuplicateDeliveriesRunHandlerOnce(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	var runs, inside atomic.Int32
	entered, release := make(chan string, 2), make(chan struct{})
	mux := tasks.NewMux()
	mux.HandleTask("test:receipt", asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
		runs.Add(1)
		if inside.Add(1) > 1 {
			return errors.New("two runs at once")
		}
		defer inside.Add(-1)
		q, _ := asynq.GetQueueName(ctx)
		entered <- q
		<-release
		return idempotency.InTx(ctx, func(tx pgx.Tx) error {
			id, _ := idempotency.JobID(ctx)
			_, err := tx.Exec(ctx, `INSERT INTO effects (job_id, name) VALUES ($1, 'receipt')`, id)
			return err
		})
	}))
	res, err := b.client.Enqueue(ctx, receipt.New(order{OrderID: "dup"}, tasks.Delay(time.Hour)))
	require.NoError(t, err)
	job := res.Job
	var signals *executor.TestSignals
	b.startWorker(t, mux, func(c *server.Config) {
		c.Queues = map[string]int{"dupA": 1}
		c.DisableRelay = true
		c.IdleWait = -1 // the copies come from a plain asynq client, which announces nothing
		signals = executor.InitTestSignals(&c.Guard)
	})
	b.startWorker(t, mux, func(c *server.Config) {
		c.Queues = map[string]int{"dupB": 1}
		c.DisableRelay = true
		c.IdleWait = -1 // the copies come from a plain asynq client, which announces nothing
		executor.ShareTestSignals(&c.Guard, signals)
	})
	ac := asynq.NewClient(b.redis)
	defer ac.Close()
	deliver := func(q string) {
		_, err := ac.Enqueue(asynq.NewTask(job.Kind, job.Payload), asynq.TaskID(job.ID), asynq.Queue(q))
		require.NoError(t, err)
	}
	// The second copy comes while the first delivery's handler runs.
	deliver("dupA")
	select {
	case q := <-entered:
		require.Equal(t, "dupA", q)
	case <-time.After(testsignal.Timeout):
		t.Fatal("the first delivery never started the handler")
	}
	deliver("dupB")
	// The other delivery found the lease held while the handler runs.
	signals.Busy.WaitFor(t, func(id string) bool { return id == job.ID })
	require.EqualValues(t, 1, runs.Load(), "the delivery that found the lease held ran the handler")
	insp := asynq.NewInspector(b.redis)
	defer insp.Close()
	// It is postponed, not failed: back in asynq's retry set.
	testenv.Eventually(t, 10*time.Second, func() bool {
		info, err := insp.GetTaskInfo("dupB", job.ID)
		return err == nil && info.State == asynq.TaskStateRetry
	}, "the delivery that found the lease held was not postponed")
	close(release)
	b.waitStatus(t, job.ID, idempotency.StatusSucceeded, 10*time.Second)
	// Its recheck comes now rather than up to 5 s later. A recheck that
	// already came (a slow host) fails the move; it is on its way anyway.
	_ = insp.RunTask("dupB", job.ID)
	// It sees the success and is acknowledged without a run.
	signals.Skipped.WaitFor(t, func(id string) bool { return id == job.ID })
	testenv.WaitAsynqIdle(t, b.redis, 10*time.Second, "dupA", "dupB")
	for _, q := range []string{"dupA", "dupB"} {
		info, err := insp.GetQueueInfo(q)
		require.NoError(t, err)
		require.Zero(t, info.Size, "queue %s still holds a delivery", q)
	}
	require.EqualValues(t, 1, runs.Load(), "handler ran more than once")
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM effects WHERE job_id = $1`, job.ID))
	j, err := b.store.Get(ctx, job.ID)
	require.NoError(t, err)
	require.Equal(t, 1, j.Attempts, "the lease-busy delivery must not count as an attempt")
}

func TestInTxRollsBackWhenLeaseWasLost(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	var inTxErr atomic.Value
	mux := tasks.NewMux()
	tasks.Handle(mux, receipt, func(ctx context.Context, o order) error {
		id, _ := idempotency.JobID(ctx)
		// Another worker takes the job over while this one runs.
		if _, err := b.pool.Exec(ctx, `UPDATE keel_jobs SET lease_holder = 'someone-else' WHERE id = $1`, id); err != nil {
			return err
		}
		err := idempotency.InTx(ctx, func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `INSERT INTO effects (job_id, name) VALUES ($1, 'receipt')`, id)
			return err
		})
		inTxErr.Store(fmt.Sprint(err))
		return err
	})
	res, err := b.client.Enqueue(ctx, receipt.New(order{OrderID: "lease"}))
	require.NoError(t, err)
	b.startWorker(t, mux, nil)
	testenv.Eventually(t, 10*time.Second, func() bool { return inTxErr.Load() != nil }, "handler never ran")
	require.Contains(t, inTxErr.Load(), idempotency.ErrLeaseLost.Error())
	require.Equal(t, 0, b.count(t, `SELECT count(*) FROM effects WHERE job_id = $1`, res.Job.ID), "effect committed without the lease")
}

func TestStepIsSkippedOnRetryAndResultIsKept(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	var calls, attempts atomic.Int32
	var second atomic.Value
	mux := tasks.NewMux()
	tasks.Handle(mux, receipt, func(ctx context.Context, o order) error {
		n := attempts.Add(1)
		ref, err := idempotency.StepValue(ctx, "charge", func(ctx context.Context, key string) (string, error) {
			calls.Add(1)
			return "ch_" + key, nil
		})
		if err != nil {
			return err
		}
		if n == 1 {
			return retry.Transient(errors.New("mail server hiccup after the charge"))
		}
		second.Store(ref)
		return nil
	})
	res, err := b.client.Enqueue(ctx, receipt.New(order{OrderID: "step"}))
	require.NoError(t, err)
	b.startWorker(t, mux, nil)
	j := b.waitStatus(t, res.Job.ID, idempotency.StatusSucceeded, 15*time.Second)
	require.EqualValues(t, 1, calls.Load(), "a finished step ran again")
	require.Equal(t, "ch_"+idempotency.StepKey(res.Job.ID, "charge"), second.Load(), "stored result not returned on retry")
	require.Equal(t, 2, j.Attempts)
	require.Empty(t, j.LastError, "a succeeded job still shows an earlier attempt's error")
	require.Empty(t, j.ErrorClass, "a succeeded job still shows an earlier attempt's class")
	steps, err := b.store.Steps(ctx, res.Job.ID)
	require.NoError(t, err)
	require.Len(t, steps, 1)
	require.Equal(t, "done", steps[0].Status)
}

// startedStep leaves a step "started" with no outcome, as a worker killed in
// the middle of the external call does.
func startedStep(t *testing.T, pool *pgxpool.Pool, jobID, name string) {
	t.Helper()
	_, err := pool.Exec(context.Background(), `INSERT INTO keel_steps (job_id, name, status) VALUES ($1, $2, 'started')`, jobID, name)
	require.NoError(t, err)
}

func TestInDoubtStepIsParkedNotRepeated(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	var calls atomic.Int32
	mux := tasks.NewMux()
	tasks.Handle(mux, receipt, func(ctx context.Context, o order) error {
		return idempotency.Step(ctx, "mail", func(ctx context.Context, key string) error {
			calls.Add(1)
			return nil
		})
	})
	res, err := b.client.Enqueue(ctx, receipt.New(order{OrderID: "doubt"}, tasks.Delay(time.Second)))
	require.NoError(t, err)
	startedStep(t, b.pool, res.Job.ID, "mail")
	b.startWorker(t, mux, nil)
	j := b.waitStatus(t, res.Job.ID, idempotency.StatusDead, 15*time.Second)
	require.EqualValues(t, 0, calls.Load(), "an in-doubt step was called blindly")
	require.Contains(t, j.LastError, "in doubt: needs a person")
	require.True(t, j.InDoubt, "the doubt is recorded as data, not only in the error's text")
	require.Equal(t, string(retry.ClassPermanent), j.ErrorClass)
	require.Equal(t, 1, j.Attempts)
	require.NotNil(t, j.FinishedAt)
	require.NotEmpty(t, j.PayloadSummary)
}

func TestInDoubtStepIsVerified(t *testing.T) {
	for _, happened := range []bool{true, false} {
		t.Run(fmt.Sprintf("happened=%v", happened), func(t *testing.T) {
			b := setup(t)
			ctx := context.Background()
			var calls, verifies atomic.Int32
			var verifiedKey atomic.Value
			mux := tasks.NewMux()
			tasks.Handle(mux, receipt, func(ctx context.Context, o order) error {
				return idempotency.Step(ctx, "mail", func(ctx context.Context, key string) error {
					calls.Add(1)
					return nil
				}, idempotency.Verify(func(ctx context.Context, key string) (bool, error) {
					verifies.Add(1)
					verifiedKey.Store(key)
					return happened, nil
				}))
			})
			res, err := b.client.Enqueue(ctx, receipt.New(order{OrderID: "verify"}, tasks.Delay(time.Second)))
			require.NoError(t, err)
			startedStep(t, b.pool, res.Job.ID, "mail")
			b.startWorker(t, mux, nil)
			b.waitStatus(t, res.Job.ID, idempotency.StatusSucceeded, 15*time.Second)
			require.EqualValues(t, 1, verifies.Load())
			require.Equal(t, idempotency.StepKey(res.Job.ID, "mail"), verifiedKey.Load())
			if happened {
				require.EqualValues(t, 0, calls.Load(), "verified step was repeated")
			} else {
				require.EqualValues(t, 1, calls.Load(), "step verified as not done must run once")
			}
		})
	}
}

func TestEnqueueTxRunsOnCommitOnly(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	var ran sync.Map
	mux := tasks.NewMux()
	tasks.Handle(mux, receipt, func(ctx context.Context, o order) error {
		if _, loaded := ran.LoadOrStore(o.OrderID, true); loaded {
			return retry.Permanent(errors.New("ran twice"))
		}
		return nil
	})
	b.startWorker(t, mux, nil)

	var committed string
	require.NoError(t, pgx.BeginFunc(ctx, b.pool, func(tx pgx.Tx) error {
		res, err := b.client.EnqueueTx(ctx, tx, receipt.New(order{OrderID: "commit"}))
		committed = res.Job.ID
		return err
	}))
	rollback := errors.New("business rule failed")
	err := pgx.BeginFunc(ctx, b.pool, func(tx pgx.Tx) error {
		if _, err := b.client.EnqueueTx(ctx, tx, receipt.New(order{OrderID: "rollback"})); err != nil {
			return err
		}
		return rollback
	})
	require.ErrorIs(t, err, rollback)

	b.waitStatus(t, committed, idempotency.StatusSucceeded, 10*time.Second)
	// The rolled-back job left no row (checked below): nothing can publish
	// it, and once asynq holds nothing more nothing can run it.
	testenv.WaitAsynqIdle(t, b.redis, 10*time.Second, "critical", "default", "low")
	_, ok := ran.Load("rollback")
	require.False(t, ok, "a rolled-back job ran")
	_, err = b.store.Lookup(ctx, receipt.Name(), "order:rollback")
	require.ErrorIs(t, err, idempotency.ErrNotFound)
}

func TestPostgresUnreachableRetriesWithoutRunningOrLosing(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	var runs atomic.Int32
	mux := tasks.NewMux()
	tasks.Handle(mux, receipt, func(ctx context.Context, o order) error {
		runs.Add(1)
		return nil
	})
	res, err := b.client.Enqueue(ctx, receipt.New(order{OrderID: "pgdown"}))
	require.NoError(t, err)

	// A worker whose ledger connection is refused.
	deadCfg, err := pgxpool.ParseConfig("postgres://postgres@127.0.0.1:1/keel_test?sslmode=disable&connect_timeout=1")
	require.NoError(t, err)
	deadPool, err := pgxpool.NewWithConfig(ctx, deadCfg)
	require.NoError(t, err)
	defer deadPool.Close()
	guard := executor.NewGuard(jobstore.NewStore(deadPool), executor.GuardConfig{LedgerRetry: time.Hour})
	defer guard.Close()
	srv := asynq.NewServer(b.redis, asynq.Config{Concurrency: 2, Queues: map[string]int{"default": 1},
		IsFailure: retry.IsFailure, RetryDelayFunc: (retry.Policy{}).WithDefaults().RetryDelayFunc(), LogLevel: asynq.FatalLevel})
	require.NoError(t, srv.Start(guard.Middleware(mux)))
	insp := asynq.NewInspector(b.redis)
	defer insp.Close()
	testenv.Eventually(t, 10*time.Second, func() bool {
		info, err := insp.GetTaskInfo("default", res.Job.ID)
		return err == nil && info.State == asynq.TaskStateRetry
	}, "task should wait in the retry set while the ledger is down")
	srv.Shutdown()
	require.EqualValues(t, 0, runs.Load(), "handler ran without the ledger")
	info, err := insp.GetTaskInfo("default", res.Job.ID)
	require.NoError(t, err)
	require.Equal(t, 0, info.Retried, "a ledger outage must not use up attempts")
	require.Contains(t, info.LastErr, "ledger unavailable")
	j, err := b.store.Get(ctx, res.Job.ID)
	require.NoError(t, err)
	require.Equal(t, idempotency.StatusPending, j.Status)

	// Ledger back: the same task runs, once.
	err = insp.RunTask("default", res.Job.ID)
	require.NoError(t, err)
	b.startWorker(t, mux, nil)
	b.waitStatus(t, res.Job.ID, idempotency.StatusSucceeded, 10*time.Second)
	require.EqualValues(t, 1, runs.Load())
}

func TestUnknownTaskIDIsRefusedPermanently(t *testing.T) {
	b := setup(t)
	var runs atomic.Int32
	mux := tasks.NewMux()
	tasks.Handle(mux, receipt, func(ctx context.Context, o order) error { runs.Add(1); return nil })
	ac := asynq.NewClient(b.redis)
	defer ac.Close()
	_, err := ac.Enqueue(asynq.NewTask(receipt.Name(), []byte(`{"order_id":"x"}`)), asynq.TaskID("not-in-ledger"))
	require.NoError(t, err)
	b.startWorker(t, mux, nil)
	waitArchived(t, inspector(t, b), "default", "not-in-ledger") // refused at once, never run
	require.EqualValues(t, 0, runs.Load())
}

func TestStepOutsideHandlerIsAnError(t *testing.T) {
	err := idempotency.Step(context.Background(), "x", func(context.Context, string) error { return nil })
	require.ErrorIs(t, err, idempotency.ErrNoJob)
	require.ErrorIs(t, idempotency.InTx(context.Background(), func(pgx.Tx) error { return nil }), idempotency.ErrNoJob)
}

// Odd error texts (NUL bytes, invalid UTF-8, megabytes) must still be
// recorded: a failure the ledger cannot store would leave the job running.
func TestOddErrorTextsAreRecorded(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	mux := tasks.NewMux()
	tasks.Handle(mux, receipt, func(ctx context.Context, o order) error {
		return retry.Permanent(errors.New("nul\x00byte, bad utf8 \xff, " + strings.Repeat("x", 1<<20)))
	})
	res, err := b.client.Enqueue(ctx, receipt.New(order{OrderID: "odd"}))
	require.NoError(t, err)
	b.startWorker(t, mux, nil)
	j := b.waitStatus(t, res.Job.ID, idempotency.StatusDead, 10*time.Second)
	require.Contains(t, j.LastError, `nul\0byte`)
	require.Contains(t, j.LastError, "(truncated)")
	require.Less(t, len(j.LastError), 9<<10)
}

// A wait recorded while the job could not start is not left behind as its
// "last error" once it succeeds.
func TestWaitIsForgottenOnSuccess(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	var calls atomic.Int32
	mux := tasks.NewMux()
	tasks.Handle(mux, receipt, func(ctx context.Context, o order) error {
		if calls.Add(1) == 1 {
			return retry.Wait(time.Second, errors.New("rate limited"))
		}
		return nil
	})
	res, err := b.client.Enqueue(ctx, receipt.New(order{OrderID: "wait"}))
	require.NoError(t, err)
	b.startWorker(t, mux, nil)
	j := b.waitStatus(t, res.Job.ID, idempotency.StatusSucceeded, 20*time.Second)
	require.Empty(t, j.LastError)
	require.Empty(t, j.ErrorClass)
	require.Equal(t, 1, j.Attempts)
}

// asynq's retry count starts again when a job is published anew (here as
// after Redis lost it); the ledger's count still ends the budget.
func TestBudgetHoldsAcrossRepublish(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	mux := tasks.NewMux()
	tasks.Handle(mux, receipt, func(ctx context.Context, o order) error {
		return retry.Transient(errors.New("still down"))
	})
	res, err := b.client.Enqueue(ctx, receipt.New(order{OrderID: "budget"}, tasks.MaxRetry(1)))
	require.NoError(t, err)
	// A retry 3 s away: the task waits in asynq's retry set (asynq keeps
	// retry times in whole seconds, so a shorter one may be due at once).
	b.startWorker(t, mux, func(c *server.Config) {
		c.DisableReconciler = true
		c.Retry.Base, c.Retry.Cap = 3*time.Second, 3*time.Second
	})
	testenv.Eventually(t, 10*time.Second, func() bool {
		j, err := b.store.Get(ctx, res.Job.ID)
		require.NoError(t, err)
		return j.Status == idempotency.StatusFailed && j.Attempts == 1
	}, "first attempt never failed")
	// Redis loses the task; it is published anew with asynq's count at zero.
	insp := asynq.NewInspector(b.redis)
	defer insp.Close()
	// asynq moves it to its retry set just after the ledger records the failure.
	testenv.Eventually(t, 10*time.Second, func() bool {
		info, err := insp.GetTaskInfo("default", res.Job.ID)
		return err == nil && info.State == asynq.TaskStateRetry
	}, "the failed attempt never reached asynq's retry set")
	require.NoError(t, insp.DeleteTask("default", res.Job.ID))
	j, err := b.store.Get(ctx, res.Job.ID)
	require.NoError(t, err)
	ac := asynq.NewClient(b.redis)
	defer ac.Close()
	_, err = ac.EnqueueContext(ctx, jobstore.Task(j), jobstore.TaskOptions(j)...)
	require.NoError(t, err)

	dead := b.waitStatus(t, res.Job.ID, idempotency.StatusDead, 15*time.Second)
	require.Equal(t, 2, dead.Attempts, "max retry 1 means two attempts in all")
	require.NotNil(t, dead.PublishedAt)
}

// A task whose id Postgres cannot hold is refused at once, and does not
// spoil the claims of the jobs that share its round.
func TestTaskIDPostgresCannotHoldIsRefused(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	var runs atomic.Int32
	mux := tasks.NewMux()
	tasks.Handle(mux, receipt, func(ctx context.Context, o order) error { runs.Add(1); return nil })
	ac := asynq.NewClient(b.redis)
	defer ac.Close()
	_, err := ac.Enqueue(asynq.NewTask(receipt.Name(), []byte(`{"order_id":"x"}`)), asynq.TaskID("bad\x00id"))
	require.NoError(t, err)
	good, err := b.client.Enqueue(ctx, receipt.New(order{OrderID: "good"}))
	require.NoError(t, err)
	b.startWorker(t, mux, nil)
	b.waitStatus(t, good.Job.ID, idempotency.StatusSucceeded, 10*time.Second)
	waitArchived(t, inspector(t, b), "default", "bad\x00id") // refused at once, never run
	require.EqualValues(t, 1, runs.Load())
}

// A person may not forget the start of a step while its job runs: the call
// may be in flight.
func TestResolveStepOnlyOnDeadJobs(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	res, err := b.client.Enqueue(ctx, receipt.New(order{OrderID: "resolve"}, tasks.Delay(time.Hour)))
	require.NoError(t, err)
	_, err = b.pool.Exec(ctx, `UPDATE keel_jobs SET status = 'running', lease_holder = 'w', lease_until = now() + interval '1 minute' WHERE id = $1`, res.Job.ID)
	require.NoError(t, err)
	startedStep(t, b.pool, res.Job.ID, "mail")
	err = testworker.Ops(t, b.store, nil).ResolveStep(ctx, res.Job.ID, "mail", false, "ops", "")
	require.ErrorIs(t, err, inspect.ErrNotDead)
	steps, err := b.store.Steps(ctx, res.Job.ID)
	require.NoError(t, err)
	require.Len(t, steps, 1, "the in-flight step's record must stay")
}

// An InTx whose commit lands just before a lease renewal reads the row
// leaves it succeeded, no longer running: the renewal must not take that
// for a lost lease and cancel the handler. Nobody else holds the job; the
// run is over and the worker was about to note it.
func TestRenewalRightAfterInTxCommitKeepsTheRun(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	var runs atomic.Int32
	causes := make(chan string, 1)
	mux := tasks.NewMux()
	tasks.Handle(mux, receipt, func(ctx context.Context, o order) error {
		runs.Add(1)
		id, _ := idempotency.JobID(ctx)
		err := idempotency.InTx(ctx, func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `INSERT INTO effects (job_id, name) VALUES ($1, 'receipt')`, id)
			return err
		})
		causes <- fmt.Sprint(context.Cause(ctx))
		return err
	})
	var log testenv.SyncBuffer
	var signals *executor.TestSignals
	var guard func() *executor.Guard
	b.startWorker(t, mux, func(c *server.Config) {
		c.Guard.Lease = 500 * time.Millisecond
		c.Logger = slog.New(slog.NewTextHandler(&log, nil))
		signals = executor.InitTestSignals(&c.Guard)
		guard = executor.GuardMadeWith(&c.Guard)
	})
	// The run is held between its commit and noting it until a renewal
	// that began after the commit has ended.
	committed, resume := make(chan string, 1), make(chan struct{})
	var resumeOnce sync.Once
	defer resumeOnce.Do(func() { close(resume) })
	guard().SetInTxCommittedHook(func(id string) {
		committed <- id
		<-resume
	})
	res, err := b.client.Enqueue(ctx, receipt.New(order{OrderID: "renewed-after-commit"}))
	require.NoError(t, err)
	var id string
	select {
	case id = <-committed:
	case <-time.After(30 * time.Second):
		t.Fatal("the handler's InTx never committed")
	}
	require.Equal(t, res.Job.ID, id)
	after := time.Now()
	r := signals.Renewed.WaitFor(t, func(r executor.Renewal) bool { return r.Began.After(after) })
	require.NotContains(t, r.Renewed, id, "a renewal after the commit renewed a lease the commit ended")
	resumeOnce.Do(func() { close(resume) })
	select {
	case cause := <-causes:
		require.Equal(t, "<nil>", cause, "the run was cancelled after its InTx committed")
	case <-time.After(30 * time.Second):
		t.Fatal("the handler never returned from its InTx")
	}
	j := b.waitStatus(t, res.Job.ID, idempotency.StatusSucceeded, 5*time.Second)
	require.Equal(t, 1, j.Attempts)
	require.EqualValues(t, 1, runs.Load())
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM effects WHERE job_id = $1`, res.Job.ID))
	require.NotContains(t, log.String(), "lease lost")
}

// A run whose job another worker claimed (its lease ran out while it was
// cut off, say) is stopped by the next renewal, even once that other run
// has finished the job: at a later attempt, or at the same attempt number
// after a replay (attempts start again from 0), but not by this run's InTx.
func TestRenewalStopsARunWhoseJobWasTakenOver(t *testing.T) {
	for name, took := range map[string]string{
		"succeeded at a later attempt": `UPDATE keel_jobs SET status = 'succeeded', lease_holder = NULL,
			attempts = attempts + 1, finished_at = now() WHERE id = $1`,
		// What takeover, death, replay and another run's success leave.
		"replayed and succeeded elsewhere at the same attempt": `UPDATE keel_jobs SET status = 'succeeded',
			lease_holder = NULL, lease_until = NULL, last_holder = 'another-worker', finished_at = now() WHERE id = $1`,
	} {
		t.Run(name, func(t *testing.T) {
			b := setup(t)
			ctx := context.Background()
			var cause atomic.Value
			mux := tasks.NewMux()
			tasks.Handle(mux, receipt, func(ctx context.Context, o order) error {
				id, _ := idempotency.JobID(ctx)
				if _, err := b.pool.Exec(ctx, took, id); err != nil {
					return err
				}
				select {
				case <-ctx.Done():
					cause.Store(context.Cause(ctx))
				case <-time.After(10 * time.Second):
					cause.Store(errors.New("never stopped"))
				}
				return nil
			})
			_, err := b.client.Enqueue(ctx, receipt.New(order{OrderID: "taken-over"}))
			require.NoError(t, err)
			b.startWorker(t, mux, func(c *server.Config) { c.Guard.Lease = 500 * time.Millisecond })
			testenv.Eventually(t, 15*time.Second, func() bool { return cause.Load() != nil }, "handler never ran")
			require.ErrorIs(t, cause.Load().(error), idempotency.ErrLeaseLost)
		})
	}
}

// A run handed back uncounted (a deploy, a wait) and claimed again by the
// same worker is a new run: the old one, still going in a goroutine keel
// gave up, must not be able to complete the new one's job.
func TestARunHandedBackUncountedCannotActForTheNextRun(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	res, err := b.client.Enqueue(ctx, receipt.New(order{OrderID: "handed-back"}))
	require.NoError(t, err)
	g := executor.NewGuard(b.store, executor.GuardConfig{Holder: "one-worker"})
	defer g.Close()
	old, err := g.ClaimForTest(ctx, res.Job.ID)
	require.NoError(t, err)
	g.ReleaseForTest(ctx, old)
	next, err := g.ClaimForTest(ctx, res.Job.ID)
	require.NoError(t, err)
	require.Equal(t, old.Attempt, next.Attempt, "a run handed back uncounted used up an attempt")

	require.ErrorIs(t, g.CompleteRoundForTest(ctx, old)[0], idempotency.ErrLeaseLost,
		"the old run completed the job the next run holds")
	renewed, err := g.RenewForTest(ctx, old)
	require.NoError(t, err)
	require.Empty(t, renewed, "the old run renewed the next run's lease")
	require.NoError(t, g.CompleteRoundForTest(ctx, next)[0])
}
