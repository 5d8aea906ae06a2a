package executor_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
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
	"github.com/keeljobs/keel/internal/testworker"
	"github.com/keeljobs/keel/retry"
	"github.com/keeljobs/keel/server"
	"github.com/keeljobs/keel/tasks"
)

// The guarantees of DESIGN's invariants 8 and 9, each on a path a chaos
// soak does not take: a job that kills its worker, a handler that ignores
// its deadline, a deploy mid-job, a rate limit, a wait on asynq's last try.

const guaranteeChildEnv = "KEEL_GUARANTEE_CHILD"

var (
	poison  = tasks.Define[order]("test:poison", tasks.MaxRetry(1), tasks.Key(func(o order) string { return o.OrderID }))
	deploy  = tasks.Define[order]("test:deploy", tasks.MaxRetry(0), tasks.Key(func(o order) string { return o.OrderID }))
	hung    = tasks.Define[order]("test:hung", tasks.MaxRetry(1), tasks.Timeout(time.Second), tasks.Key(func(o order) string { return o.OrderID }))
	limited = tasks.Define[order]("test:limited", tasks.MaxRetry(1), tasks.Key(func(o order) string { return o.OrderID }))
	patient = tasks.Define[order]("test:patient", tasks.MaxRetry(1), tasks.MaxWait(1500*time.Millisecond), tasks.Key(func(o order) string { return o.OrderID }))
	oneShot = tasks.Define[order]("test:one_shot", tasks.MaxRetry(0), tasks.Key(func(o order) string { return o.OrderID }))
	late    = tasks.Define[order]("test:late", tasks.MaxRetry(3), tasks.Key(func(o order) string { return o.OrderID }))
)

// guaranteeMux is what the child workers run. Every handler records that it
// started (committed before anything else), so the parent counts runs.
func guaranteeMux(pool *pgxpool.Pool) *tasks.Mux {
	started := func(ctx context.Context) error {
		id, _ := idempotency.JobID(ctx)
		_, err := pool.Exec(ctx, `INSERT INTO started (job_id) VALUES ($1)`, id)
		return err
	}
	mux := tasks.NewMux()
	tasks.Handle(mux, poison, func(ctx context.Context, o order) error {
		if err := started(ctx); err != nil {
			return err
		}
		os.Exit(3) // what an OOM kill or a segfault does to the worker
		return nil
	})
	tasks.Handle(mux, deploy, func(ctx context.Context, o order) error {
		if err := started(ctx); err != nil {
			return err
		}
		<-ctx.Done() // a long job, still running when the deploy comes
		return fmt.Errorf("sending: %w", ctx.Err())
	})
	return mux
}

// runGuaranteeChild runs a worker when the test binary is started as one
// of these tests' children.
func runGuaranteeChild() bool {
	return testworker.RunChildWorker(guaranteeChildEnv, func(pool *pgxpool.Pool) (server.Config, asynq.Handler) {
		scfg := server.Config{
			Redis:           redisOpt(),
			Concurrency:     5,
			ShutdownTimeout: time.Second,
			Guard: executor.GuardConfig{
				Lease: 2 * time.Second,
				OnDead: func(ctx context.Context, e jobstore.DeadEvent) {
					_, _ = pool.Exec(context.WithoutCancel(ctx), `INSERT INTO deaths (job_id, class) VALUES ($1, $2)`, e.JobID, e.Class)
				},
			},
		}
		scfg.Retry.Base, scfg.Retry.Cap = time.Second, time.Second
		return scfg, guaranteeMux(pool)
	})
}

// startGuaranteeChild starts a worker process; the channel closes when it
// exits.
func startGuaranteeChild(t *testing.T, b *bundle) (*exec.Cmd, <-chan struct{}) {
	t.Helper()
	child := exec.Command(os.Args[0], "-test.run=^$")
	child.Env = b.childEnv(guaranteeChildEnv)
	child.Stdout, child.Stderr = os.Stderr, os.Stderr
	require.NoError(t, child.Start())
	exited := make(chan struct{})
	go func() { _ = child.Wait(); close(exited) }()
	t.Cleanup(func() {
		_ = child.Process.Kill()
		<-exited
	})
	return child, exited
}

func guaranteeTables(t *testing.T, b *bundle) {
	t.Helper()
	_, err := b.pool.Exec(context.Background(), `CREATE TABLE started (job_id text, at timestamptz DEFAULT clock_timestamp());
		CREATE TABLE deaths (job_id text, class text)`)
	require.NoError(t, err)
}

// A job whose run kills its worker retires after its budget instead of
// killing workers for ever: dead, class crashed, with the alert every death
// gets, and never run beyond its budget.
func TestPoisonJobRetires(t *testing.T) {
	b := setup(t)
	guaranteeTables(t, b)
	ctx := context.Background()
	res, err := b.client.Enqueue(ctx, poison.New(order{OrderID: "p1"}))
	require.NoError(t, err)

	// Each child dies in the handler; the next one is started at once and
	// takes the job over when the dead one's lease has expired, which the
	// test moves time on for.
	deadline := time.Now().Add(90 * time.Second)
	for {
		child, exited := startGuaranteeChild(t, b)
		var j idempotency.Job
		for {
			j, err = b.store.Get(ctx, res.Job.ID)
			require.NoError(t, err)
			if j.Status == idempotency.StatusDead {
				break
			}
			select {
			case <-exited:
				testworker.LapseKilledWorker(t, b.pool, b.redis, child.Process.Pid)
			case <-time.After(20 * time.Millisecond):
				require.True(t, time.Now().Before(deadline), "the poison job never retired: %+v", j)
				continue
			}
			break
		}
		if j.Status == idempotency.StatusDead {
			require.Equal(t, string(retry.ClassCrashed), j.ErrorClass)
			require.Contains(t, j.LastError, "2 of 2 runs ended without an outcome")
			require.Contains(t, j.LastError, "last held by ")
			require.Equal(t, 2, b.count(t, `SELECT count(*) FROM started WHERE job_id = $1`, res.Job.ID),
				"a MaxRetry(1) job ran more than twice")
			testenv.Eventually(t, 10*time.Second, func() bool {
				return b.count(t, `SELECT count(*) FROM deaths WHERE job_id = $1 AND class = 'crashed'`, res.Job.ID) == 1
			}, "the retired poison job raised no death alert")
			return
		}
	}
}

type customer struct{ Email string }

type orderFor struct {
	OrderID  string    `json:"order_id"`
	Customer *customer `json:"customer"`
}

// A Summary that redacts the customer's address, and panics on an order
// without one: its own bug, on the very payloads that fail.
var summaryPanics = tasks.Define[orderFor]("test:summary_panics", tasks.MaxRetry(0),
	tasks.Key(func(o orderFor) string { return o.OrderID }),
	tasks.Summary(func(o orderFor) string { return "order " + o.OrderID + " for " + o.Customer.Email[:1] + "…" }))

// A kind's Summary that panics does not stop a death being recorded: the
// poison job is dead once, with a summary that says what went wrong and
// shows nothing of the payload, instead of running, failing and panicking
// again for ever.
func TestAPanickingSummaryDoesNotKeepAPoisonJobAlive(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	var runs atomic.Int32
	mux := tasks.NewMux()
	tasks.Handle(mux, summaryPanics, func(ctx context.Context, o orderFor) error {
		runs.Add(1)
		return retry.Permanent(errors.New("order has no customer"))
	})
	b.startWorker(t, mux, nil)
	// Raw JSON, as keel enqueue, a cron entry or another language enqueues it.
	res, err := b.client.Enqueue(ctx, tasks.NewRaw(summaryPanics.Name(), []byte(`{"order_id":"no-customer","secret":"s3cret"}`), "no-customer"))
	require.NoError(t, err)
	j := b.waitStatus(t, res.Job.ID, idempotency.StatusDead, 20*time.Second)
	require.Equal(t, string(retry.ClassPermanent), j.ErrorClass)
	require.Contains(t, j.LastError, "order has no customer")
	require.Contains(t, j.PayloadSummary, "panicked")
	require.NotContains(t, j.PayloadSummary, "s3cret", "a Summary that failed must not leave the payload unredacted")
	require.EqualValues(t, 1, runs.Load())
}

var (
	deployStep   = tasks.Define[order]("test:deploy_step", tasks.MaxRetry(3), tasks.Key(func(o order) string { return "order:" + o.OrderID }))
	deployIgnore = tasks.Define[order]("test:deploy_ignores", tasks.MaxRetry(0), tasks.Key(func(o order) string { return "order:" + o.OrderID }))
)

// A deploy whose ShutdownTimeout ends while a step's call is in flight
// lets the call finish and records its answer: the job is not left in
// doubt and parked for a person, and the call is made once. Runs outside a
// call are given up at once meanwhile, not held back by the wait.
func TestADeployLetsAStepsCallInFlightFinish(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	var posts, answered atomic.Int32
	release := make(chan struct{})
	api := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		posts.Add(1)
		<-release // a slow, healthy provider, still working when the deploy's timeout ends
		answered.Add(1)
		w.WriteHeader(http.StatusOK)
	}))
	defer api.Close()
	client := &http.Client{Timeout: 10 * time.Second}
	ignoring := make(chan struct{})
	var ignoringOnce sync.Once
	mux := tasks.NewMux()
	tasks.Handle(mux, deployStep, func(ctx context.Context, o order) error {
		return idempotency.StepHTTP(ctx, "charge", client, func(ctx context.Context, key string) (*http.Request, error) {
			return http.NewRequestWithContext(ctx, http.MethodPost, api.URL+"/charges", strings.NewReader(`{"amount":42}`))
		})
	})
	tasks.Handle(mux, deployIgnore, func(ctx context.Context, o order) error {
		ignoringOnce.Do(func() { close(ignoring) })
		<-release // ignores its context
		return nil
	})
	cfg := server.Config{Redis: b.redis, Pool: b.pool, Concurrency: 2, ShutdownTimeout: 200 * time.Millisecond}
	cfg.Relay.PollInterval = 200 * time.Millisecond
	srv, err := server.New(cfg, mux)
	require.NoError(t, err)
	runCtx, deploy := context.WithCancel(ctx)
	stopped := make(chan error, 1)
	go func() { stopped <- srv.Run(runCtx) }()

	res, err := b.client.Enqueue(ctx, deployStep.New(order{OrderID: "deploy-step"}))
	require.NoError(t, err)
	other, err := b.client.Enqueue(ctx, deployIgnore.New(order{OrderID: "deploy-ignores"}))
	require.NoError(t, err)
	testenv.Eventually(t, 10*time.Second, func() bool { return posts.Load() == 1 }, "the call never started")
	<-ignoring
	deploy() // SIGTERM while the call is in flight
	// The shutdown timeout ends: asynq gives both runs up and puts their
	// tasks back. The run outside a call is released at once.
	insp := asynq.NewInspector(b.redis)
	defer insp.Close()
	testenv.Eventually(t, 10*time.Second, func() bool {
		info, err := insp.GetTaskInfo("default", res.Job.ID)
		return err == nil && info.State == asynq.TaskStatePending
	}, "asynq never gave the run up")
	b.waitStatus(t, other.Job.ID, idempotency.StatusPending, 3*time.Second)
	// The call's answer comes, and its record waits for a lock a while:
	// the worker stops only once it is written.
	hold, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	_, err = hold.Exec(ctx, `SELECT 1 FROM keel_steps WHERE job_id = $1 FOR UPDATE`, res.Job.ID)
	require.NoError(t, err)
	close(release)
	testenv.Eventually(t, 10*time.Second, func() bool { return answered.Load() == 1 }, "the provider never answered")
	holdPID := int(hold.Conn().PgConn().PID())
	testenv.Eventually(t, 10*time.Second, func() bool {
		return b.count(t, `SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY (pg_blocking_pids(pid))`, holdPID) > 0
	}, "the call's record never waited for the step's row")
	select {
	case err := <-stopped:
		t.Fatalf("the worker stopped while the call's answer waited to be recorded: %v", err)
	default:
	}
	require.NoError(t, hold.Rollback(ctx))
	require.NoError(t, <-stopped)
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM keel_steps WHERE job_id = $1 AND name = 'charge' AND status = 'done'`, res.Job.ID),
		"the worker stopped before the call's answer was recorded")

	if j, err := b.store.Get(ctx, res.Job.ID); err != nil || j.Status != idempotency.StatusSucceeded {
		b.startWorker(t, mux, nil) // the new version
	}
	j := b.waitStatus(t, res.Job.ID, idempotency.StatusSucceeded, 20*time.Second)
	require.EqualValues(t, 1, posts.Load(), "the charge was sent again")
	require.Empty(t, j.LastError)
}

// SIGTERM with a 1 s shutdown timeout in the middle of a MaxRetry(0) job:
// the run does not count, makes no dead letter and no alert, and the job's
// lease is released at once, so the next worker starts it without waiting
// for the lease to expire.
func TestDeployInterruptionCostsNothing(t *testing.T) {
	b := setup(t)
	guaranteeTables(t, b)
	ctx := context.Background()
	res, err := b.client.Enqueue(ctx, deploy.New(order{OrderID: "d1"}))
	require.NoError(t, err)
	child, exited := startGuaranteeChild(t, b)
	testenv.Eventually(t, 20*time.Second, func() bool {
		return b.count(t, `SELECT count(*) FROM started`) == 1
	}, "the child never started the job")
	require.NoError(t, child.Process.Signal(syscall.SIGTERM))
	<-exited

	j, err := b.store.Get(ctx, res.Job.ID)
	require.NoError(t, err)
	require.Equal(t, idempotency.StatusPending, j.Status, "interrupted job: %+v", j)
	require.Equal(t, 0, j.Attempts, "the deploy used up an attempt")
	require.Empty(t, j.LeaseHolder, "the interrupted job keeps its lease")
	require.Equal(t, 0, b.count(t, `SELECT count(*) FROM deaths`), "a deploy raised an alert")

	// The next worker starts it at once: a held lease would answer "busy"
	// until it expired, which the busy counter shows.
	done := make(chan struct{})
	mux := tasks.NewMux()
	tasks.Handle(mux, deploy, func(ctx context.Context, o order) error {
		defer close(done)
		return nil
	})
	srv := b.startWorker(t, mux, func(c *server.Config) { c.Guard.Lease = time.Minute })
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("the next worker never started the interrupted job")
	}
	j = b.waitStatus(t, res.Job.ID, idempotency.StatusSucceeded, 10*time.Second)
	require.Equal(t, 1, j.Attempts)
	require.Zero(t, srv.GuardStats().LeaseBusy, "the next worker found the interrupted job's lease still held")
}

// A handler that ignores its context is given up at its deadline plus the
// grace: the attempt counts (class timeout), the job retries and dies by its
// budget, and the stuck goroutines' late InTx can never commit.
func TestHungHandlerIsGivenUp(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	release := make(chan struct{})
	var freeOnce sync.Once
	var entered, returned atomic.Int32
	free := func() {
		freeOnce.Do(func() { close(release) })
		testenv.Eventually(t, 10*time.Second, func() bool { return returned.Load() == entered.Load() }, "hung goroutines never returned")
	}
	defer free() // before the worker stops
	var lateErrs, lateStepErrs sync.Map
	var lateCalls atomic.Int32
	mux := tasks.NewMux()
	tasks.Handle(mux, hung, func(ctx context.Context, o order) error {
		entered.Add(1)
		defer returned.Add(1)
		attempt := idempotency.Attempt(ctx)
		<-release // ignores ctx
		serr := idempotency.Step(ctx, "late-call", func(ctx context.Context, key string) error {
			lateCalls.Add(1)
			return nil
		})
		lateStepErrs.Store(attempt, serr)
		err := idempotency.InTx(ctx, func(tx pgx.Tx) error {
			id, _ := idempotency.JobID(ctx)
			_, err := tx.Exec(ctx, `INSERT INTO effects (job_id, name) VALUES ($1, 'late')`, id)
			return err
		})
		lateErrs.Store(attempt, err)
		return err
	})
	srv := b.startWorker(t, mux, func(c *server.Config) { c.Guard.TimeoutGrace = 500 * time.Millisecond })
	res, err := b.client.Enqueue(ctx, hung.New(order{OrderID: "h1"}))
	require.NoError(t, err)

	j := b.waitStatus(t, res.Job.ID, idempotency.StatusDead, 60*time.Second)
	require.Equal(t, string(retry.ClassTimeout), j.ErrorClass)
	require.Equal(t, 2, j.Attempts, "a MaxRetry(1) job runs twice")
	require.Contains(t, j.LastError, "after its deadline")
	require.EqualValues(t, 2, srv.GuardStats().Overran)
	require.Equal(t, 2, srv.GuardStats().HungHandlers, "both attempts' handlers still run")

	free()
	// A handler counts until the guard has seen it return, just after.
	testenv.Eventually(t, 10*time.Second, func() bool { return srv.GuardStats().HungHandlers == 0 },
		"the hung handlers returned, and still count")
	for attempt := 1; attempt <= 2; attempt++ {
		v, ok := lateErrs.Load(attempt)
		require.True(t, ok, "attempt %d's goroutine never returned", attempt)
		require.ErrorIs(t, v.(error), idempotency.ErrRunGivenUp, "attempt %d", attempt)
		v, _ = lateStepErrs.Load(attempt)
		require.ErrorIs(t, v.(error), idempotency.ErrRunGivenUp, "attempt %d's late step", attempt)
	}
	require.Zero(t, lateCalls.Load(), "a given-up run made its external call")
	require.Equal(t, 0, b.count(t, `SELECT count(*) FROM effects`), "a given-up run committed its effect")
	j, err = b.store.Get(ctx, res.Job.ID)
	require.NoError(t, err)
	require.Equal(t, idempotency.StatusDead, j.Status)
}

// A 429 with Retry-After, three times, on a MaxRetry(1) job: waits, not
// failures, so the job succeeds on the fourth call with one attempt used.
func TestRetryAfterIsAWaitNotAnAttempt(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	var calls atomic.Int32
	api := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if calls.Add(1) <= 3 {
			w.Header().Set("Retry-After", "1")
			w.WriteHeader(http.StatusTooManyRequests)
			return
		}
		w.WriteHeader(http.StatusOK)
	}))
	defer api.Close()
	call := func(ctx context.Context) error {
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, api.URL, nil)
		if err != nil {
			return err
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		return retry.FromResponse(resp)
	}
	mux := tasks.NewMux()
	tasks.Handle(mux, limited, func(ctx context.Context, o order) error { return call(ctx) })
	tasks.Handle(mux, patient, func(ctx context.Context, o order) error { return call(ctx) })
	b.startWorker(t, mux, nil)
	// When the waits end is not what this test is about: they run again at
	// once. The time a wait counts against the ceiling is the delay it
	// asked for.
	hurryRetries(t, b, "default")

	res, err := b.client.Enqueue(ctx, limited.New(order{OrderID: "l1"}))
	require.NoError(t, err)
	j := b.waitStatus(t, res.Job.ID, idempotency.StatusSucceeded, 30*time.Second)
	require.EqualValues(t, 4, calls.Load())
	require.Equal(t, 1, j.Attempts, "the 429s used up attempts")

	// With a wait ceiling of 1.5 s the second 1 s wait is one too many.
	calls.Store(0)
	res, err = b.client.Enqueue(ctx, patient.New(order{OrderID: "p1"}))
	require.NoError(t, err)
	j = b.waitStatus(t, res.Job.ID, idempotency.StatusDead, 30*time.Second)
	require.Equal(t, string(retry.ClassWaitedTooLong), j.ErrorClass)
	require.Contains(t, j.LastError, "wait ceiling")
	require.EqualValues(t, 2, calls.Load())
}

// A wait on asynq's last try (a task asynq counts as out of tries: one
// published by an older keel without the retry headroom, say) is handed back
// to the relay; a fast relay must not publish it while asynq still holds the
// old copy (a conflict the relay takes for success), or the job is stranded
// until the reconciler's grace.
func TestWaitOnLastTryIsNotStranded(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	var seen sync.Map
	mux := tasks.NewMux()
	tasks.Handle(mux, oneShot, func(ctx context.Context, o order) error {
		if _, again := seen.LoadOrStore(o.OrderID, true); !again {
			return retry.Wait(100*time.Millisecond, errors.New("slot taken"))
		}
		return nil
	})
	insp := inspector(t, b)
	pub := asynq.NewClient(b.redis)
	defer pub.Close()
	var ids []string
	for i := range 20 {
		res, err := b.client.Enqueue(ctx, oneShot.New(order{OrderID: fmt.Sprint("w", i)}, tasks.Delay(time.Hour)))
		require.NoError(t, err)
		require.NoError(t, insp.DeleteTask("default", res.Job.ID))
		_, err = pub.Enqueue(asynq.NewTask(oneShot.Name(), res.Job.Payload), asynq.TaskID(res.Job.ID), asynq.MaxRetry(0))
		require.NoError(t, err)
		ids = append(ids, res.Job.ID)
	}
	b.startWorker(t, mux, func(c *server.Config) {
		c.Relay.PollInterval = 5 * time.Millisecond
		c.DisableReconciler = true // the repair this test must not need
	})
	for _, id := range ids {
		j := b.waitStatus(t, id, idempotency.StatusSucceeded, 30*time.Second)
		require.Equal(t, 1, j.Attempts, "a wait used up an attempt")
	}
}

// failAfterInTx is a handler whose completing InTx writes one effect and
// which then fails; runs, when not nil, counts its runs.
func failAfterInTx(runs *atomic.Int32) func(ctx context.Context, o order) error {
	return func(ctx context.Context, o order) error {
		if runs != nil {
			runs.Add(1)
		}
		if err := idempotency.InTx(ctx, func(tx pgx.Tx) error {
			id, _ := idempotency.JobID(ctx)
			_, err := tx.Exec(ctx, `INSERT INTO effects (job_id, name) VALUES ($1, 'local')`, id)
			return err
		}); err != nil {
			return err
		}
		return errors.New("the mail after the commit failed")
	}
}

// A handler that fails after its completing InTx committed is not reported
// succeeded: the work it counted on after the commit did not happen.
func TestFailureAfterCompletingInTxIsNotASuccess(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	mux := tasks.NewMux()
	tasks.Handle(mux, late, failAfterInTx(nil))
	var deaths deadEvents
	b.startWorker(t, mux, onDead(&deaths))
	res, err := b.client.Enqueue(ctx, late.New(order{OrderID: "a1"}))
	require.NoError(t, err)
	j := b.waitStatus(t, res.Job.ID, idempotency.StatusDead, 15*time.Second)
	require.Contains(t, j.LastError, "after its completing InTx")
	require.Contains(t, j.LastError, "the mail after the commit failed")
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM effects`), "the committed effect must stay, once")
	testenv.Eventually(t, 5*time.Second, func() bool { return len(deaths.of(res.Job.ID)) == 1 }, "no death alert")
}

// Replaying a job whose completing InTx committed before its handler failed
// would run that InTx's local effects again: the replay is refused, alone
// and in bulk, and the effect stays once.
func TestReplayAfterCompletingInTxIsRefused(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	var runs atomic.Int32
	mux := tasks.NewMux()
	tasks.Handle(mux, late, failAfterInTx(&runs))
	b.startWorker(t, mux, nil)
	res, err := b.client.Enqueue(ctx, late.New(order{OrderID: "r1"}))
	require.NoError(t, err)
	b.waitStatus(t, res.Job.ID, idempotency.StatusDead, 15*time.Second)

	_, err = testworker.Ops(t, b.store, nil).Replay(ctx, res.Job.ID, "ops", "try again")
	require.ErrorIs(t, err, inspect.ErrEffectsCommitted)
	require.Contains(t, err.Error(), res.Job.ID)
	f := inspect.Filter{Kind: late.Name()}
	n, err := testworker.Ops(t, b.store, nil).Count(ctx, f)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	bulk, err := testworker.Ops(t, b.store, nil).ReplayMatching(ctx, f, n, "ops", "all of them")
	require.NoError(t, err)
	require.Equal(t, 0, bulk.Done)
	require.ErrorIs(t, bulk.Failed[res.Job.ID], inspect.ErrEffectsCommitted)

	j, err := b.store.Get(ctx, res.Job.ID)
	require.NoError(t, err)
	require.Equal(t, idempotency.StatusDead, j.Status, "a refused replay leaves the job dead")
	require.NotNil(t, j.EffectsCommittedAt)
	require.Equal(t, int32(1), runs.Load())
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM effects`), "the committed effect must stay, once")

	// Discarding it, with a note, is how a person closes it.
	_, err = testworker.Ops(t, b.store, nil).Discard(ctx, res.Job.ID, "ops", "mailed by hand")
	require.NoError(t, err)
}

// A job that died the same way without effects_committed_at (before
// migration 0011: the row an older failedAfterComplete writes) is refused
// too, once the migration that records it as data has run.
func TestReplayAfterCompletingInTxIsRefusedWithoutTheColumn(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	j, _, err := b.store.Insert(ctx, b.pool, jobstore.NewJob{Kind: late.Name(), BusinessKey: "old-worker",
		Queue: "default", Payload: []byte(`{}`), MaxRetry: 3})
	require.NoError(t, err)
	_, err = b.pool.Exec(ctx, `UPDATE keel_jobs SET status = 'dead', error_class = 'permanent', attempts = 1,
		finished_at = now(), last_error = 'keel: handler failed after its completing InTx committed '
		|| '(its local effects are in; what came after did not happen; steps must come before the completing InTx): boom'
		WHERE id = $1`, j.ID)
	require.NoError(t, err)
	testenv.ReapplyMigration(t, b.pool, "effects_as_data")

	got, err := b.store.Get(ctx, j.ID)
	require.NoError(t, err)
	require.NotNil(t, got.EffectsCommittedAt)
	_, err = testworker.Ops(t, b.store, nil).Replay(ctx, j.ID, "ops", "try again")
	require.ErrorIs(t, err, inspect.ErrEffectsCommitted)
	got, err = b.store.Get(ctx, j.ID)
	require.NoError(t, err)
	require.Equal(t, idempotency.StatusDead, got.Status)
}

// A second InTx after the completing one does not run, and the job is not
// reported succeeded without it.
func TestSecondInTxDoesNotRunAndIsNotASuccess(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	var second atomic.Value
	twice := tasks.Define[order]("test:twice", tasks.Key(func(o order) string { return o.OrderID }))
	mux := tasks.NewMux()
	tasks.Handle(mux, twice, func(ctx context.Context, o order) error {
		insert := func(name string) error {
			return idempotency.InTx(ctx, func(tx pgx.Tx) error {
				id, _ := idempotency.JobID(ctx)
				_, err := tx.Exec(ctx, `INSERT INTO effects (job_id, name) VALUES ($1, $2)`, id, name)
				return err
			})
		}
		if err := insert("first"); err != nil {
			return err
		}
		err := insert("second")
		second.Store(err)
		return err
	})
	b.startWorker(t, mux, nil)
	res, err := b.client.Enqueue(ctx, twice.New(order{OrderID: "t1"}))
	require.NoError(t, err)
	j := b.waitStatus(t, res.Job.ID, idempotency.StatusDead, 15*time.Second)
	require.ErrorIs(t, second.Load().(error), idempotency.ErrAlreadyCompleted)
	require.Contains(t, j.LastError, "already completed")
	require.Equal(t, 0, b.count(t, `SELECT count(*) FROM effects WHERE name = 'second'`))
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM effects WHERE name = 'first'`))
}

// firstCommitFails makes the first COMMIT of a transaction that inserts
// into effects run onFirst (PL/pgSQL) inside a deferred trigger, runs a
// worker whose handler inserts its effect in InTx, enqueues one job of
// kind, and returns the job once it succeeded with the first InTx error.
// A sequence remembers the first time across the rollback.
func firstCommitFails(t *testing.T, b *bundle, kind, onFirst string) (idempotency.Job, error) {
	t.Helper()
	ctx := context.Background()
	_, err := b.pool.Exec(ctx, `CREATE SEQUENCE first_commit;
		CREATE FUNCTION fail_first_commit() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
			IF nextval('first_commit') = 1 THEN
				`+onFirst+`;
			END IF;
			RETURN NULL;
		END $$;
		CREATE CONSTRAINT TRIGGER fail_first AFTER INSERT ON effects
			DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION fail_first_commit()`)
	require.NoError(t, err)
	var firstErr atomic.Value
	k := tasks.Define[order](kind, tasks.Key(func(o order) string { return o.OrderID }))
	mux := tasks.NewMux()
	tasks.Handle(mux, k, func(ctx context.Context, o order) error {
		err := idempotency.InTx(ctx, func(tx pgx.Tx) error {
			id, _ := idempotency.JobID(ctx)
			_, err := tx.Exec(ctx, `INSERT INTO effects (job_id, name) VALUES ($1, 'local')`, id)
			return err
		})
		if err != nil {
			firstErr.CompareAndSwap(nil, err)
		}
		return err
	})
	b.startWorker(t, mux, nil)
	res, err := b.client.Enqueue(ctx, k.New(order{OrderID: "c1"}))
	require.NoError(t, err)
	j := b.waitStatus(t, res.Job.ID, idempotency.StatusSucceeded, 30*time.Second)
	first, _ := firstErr.Load().(error)
	return j, first
}

// A connection lost during InTx's COMMIT leaves the outcome unknown: the
// error says "commit in doubt" (not "lease lost"), and the guard looks at
// the row before it records anything. Here the commit did not land: a lost
// ledger connection is a wait, so the attempt does not count, and the next
// run commits the effect once.
func TestInTxCommitInDoubt(t *testing.T) {
	b := setup(t)
	// The session ends inside COMMIT, as a network cut at that moment would.
	j, first := firstCommitFails(t, b, "test:doubtful", `PERFORM pg_terminate_backend(pg_backend_pid())`)
	require.Error(t, first)
	require.ErrorContains(t, first, "commit in doubt")
	require.NotErrorIs(t, first, idempotency.ErrLeaseLost)
	require.ErrorIs(t, first, idempotency.ErrLedgerUnavailable)
	require.Equal(t, 1, j.Attempts, "a lost ledger connection used up an attempt")
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM effects`), "the effect must be committed once")
}

// A COMMIT Postgres refuses (a serialization failure, a deferred check) is
// an answer, not a lost connection: nothing committed, so the run's error
// is an ordinary failure, never "commit in doubt", and the next run
// commits the effect once.
func TestInTxCommitRefusedIsNotInDoubt(t *testing.T) {
	b := setup(t)
	j, first := firstCommitFails(t, b, "test:refused_commit", `RAISE EXCEPTION 'refused at commit' USING ERRCODE = '40001'`)
	require.Error(t, first)
	require.ErrorContains(t, first, "refused at commit")
	require.NotContains(t, first.Error(), "commit in doubt")
	require.Equal(t, 2, j.Attempts, "the refused commit is the first attempt's failure")
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM effects`), "the effect must be committed once")
}

// A claim the delivery stopped waiting for (its context ended while
// Postgres was slow) that lands afterwards is given back: the run never
// started, so it must not count as a crash or an attempt.
func TestLateClaimIsGivenBack(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	slow := tasks.Define[order]("test:slow_claim", tasks.MaxRetry(0), tasks.Timeout(time.Second),
		tasks.Key(func(o order) string { return o.OrderID }))
	var runs atomic.Int32
	mux := tasks.NewMux()
	tasks.Handle(mux, slow, func(ctx context.Context, o order) error {
		runs.Add(1)
		return nil
	})
	res, err := b.client.Enqueue(ctx, slow.New(order{OrderID: "s1"}))
	require.NoError(t, err)

	// Writes to the ledger wait behind this lock, claims included.
	lock, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	_, err = lock.Exec(ctx, `LOCK TABLE keel_jobs IN EXCLUSIVE MODE`)
	require.NoError(t, err)
	var signals *executor.TestSignals
	srv := b.startWorker(t, mux, func(c *server.Config) {
		c.DisableRelay, c.DisableReconciler = true, true
		signals = executor.InitTestSignals(&c.Guard)
	})
	require.Equal(t, res.Job.ID, signals.LateClaim.Wait(t), "the claim never gave up waiting")
	require.NotZero(t, srv.GuardStats().LateClaims)
	require.NoError(t, lock.Rollback(ctx)) // the abandoned claim lands now

	j := b.waitStatus(t, res.Job.ID, idempotency.StatusSucceeded, 30*time.Second)
	require.Equal(t, 1, j.Attempts, "the late claim counted as an attempt")
	require.EqualValues(t, 1, runs.Load())
	require.Equal(t, 0, b.count(t, `SELECT crashes FROM keel_jobs WHERE id = $1`, res.Job.ID), "the late claim counted as a crash")
}

// Replay starts a dead job's counters afresh: its waits and crashes too.
func TestReplayStartsWaitsAndCrashesAfresh(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	res, err := b.client.Enqueue(ctx, receipt.New(order{OrderID: "replayed"}, tasks.Delay(time.Hour)))
	require.NoError(t, err)
	_, err = b.pool.Exec(ctx, `UPDATE keel_jobs SET status = 'dead', error_class = 'waited_too_long', attempts = 3,
		waited_ms = 90000000, crashes = 2, finished_at = now() WHERE id = $1`, res.Job.ID)
	require.NoError(t, err)
	_, err = testworker.Ops(t, b.store, inspector(t, b)).Replay(ctx, res.Job.ID, "test", "fixed")
	require.NoError(t, err)
	require.Equal(t, 0, b.count(t, `SELECT waited_ms + crashes + attempts FROM keel_jobs WHERE id = $1`, res.Job.ID))
}

// A request whose write failed after every declared byte had left reached
// the other side: in doubt, not "not sent".
func TestDoHTTPWriteErrorAfterTheWholeRequestIsInDoubt(t *testing.T) {
	var received atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		received.Add(1)
		// No answer until the client hangs up: an answer racing the
		// client's write error would be taken, and rightly, as the
		// request's outcome.
		_, _ = io.Copy(io.Discard, r.Body)
		<-r.Context().Done()
	}))
	defer srv.Close()
	body := make([]byte, 8292)
	req, err := http.NewRequest(http.MethodPost, srv.URL, bytes.NewReader(body))
	require.NoError(t, err)
	req.ContentLength = 8192 // the body is longer: the write fails after the declared bytes
	_, err = idempotency.DoHTTP(srv.Client(), req, "job:step")
	require.Error(t, err)
	require.NotErrorIs(t, err, idempotency.ErrNotSent, "a request the server may have acted on counted as not sent")
	require.ErrorIs(t, err, idempotency.ErrInDoubt)
}

// A 500 may come after the effect: in doubt. A 503 with Retry-After is the
// server saying "not now": not in doubt.
func TestDoHTTPServerErrorsAreInDoubt(t *testing.T) {
	status := atomic.Int32{}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if status.Load() == http.StatusServiceUnavailable {
			w.Header().Set("Retry-After", "1")
		}
		w.WriteHeader(int(status.Load()))
	}))
	defer srv.Close()
	for code, doubt := range map[int32]bool{500: true, 503: false, 422: false} {
		status.Store(code)
		req, err := http.NewRequest(http.MethodPost, srv.URL, strings.NewReader("{}"))
		require.NoError(t, err)
		_, err = idempotency.DoHTTP(srv.Client(), req, "job:step")
		require.Error(t, err)
		require.Equal(t, doubt, errors.Is(err, idempotency.ErrInDoubt), "status %d", code)
	}
}

var (
	hookDies    = tasks.Define[order]("test:hook_dies", tasks.MaxRetry(0), tasks.Key(func(o order) string { return "order:" + o.OrderID }))
	hookBlocks  = tasks.Define[order]("test:hook_blocks", tasks.Key(func(o order) string { return "order:" + o.OrderID }))
	hookAfterOK = tasks.Define[order]("test:hook_after", tasks.Key(func(o order) string { return "order:" + o.OrderID }))
)

// An OnDead hook is the application's code (an alerter, a pager): one that
// panics must not turn a recorded death into a delivery asynq retries, and
// an OnCancelled hook that panics — it runs on the lease-renewal goroutine
// when the renewal finds the job cancelled — must not take the worker, and
// every job it runs, down with it.
func TestPanickingHooksDoNotUndoADeathOrStopTheWorker(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	var deaths atomic.Int32
	cancelled := make(chan string, 1)
	log := &testenv.SyncBuffer{}
	mux := tasks.NewMux()
	tasks.Handle(mux, hookDies, func(ctx context.Context, o order) error {
		return retry.Permanent(errors.New("no such customer"))
	})
	started := make(chan struct{}, 1)
	tasks.Handle(mux, hookBlocks, func(ctx context.Context, o order) error {
		started <- struct{}{}
		<-ctx.Done()
		return ctx.Err()
	})
	tasks.Handle(mux, hookAfterOK, func(ctx context.Context, o order) error { return nil })
	b.startWorker(t, mux, func(c *server.Config) {
		c.Logger = slog.New(slog.NewTextHandler(log, nil))
		c.Guard.Lease = time.Second // the renewal looks every 200 ms
		c.Guard.OnDead = func(context.Context, jobstore.DeadEvent) {
			deaths.Add(1)
			panic("pager unreachable")
		}
		c.Guard.OnCancelled = func(_ context.Context, e executor.CancelEvent) {
			cancelled <- e.JobID
			panic("metrics registry gone")
		}
	})
	insp := asynq.NewInspector(b.redis)
	defer insp.Close()

	dead, err := b.client.Enqueue(ctx, hookDies.New(order{OrderID: "hook-1"}))
	require.NoError(t, err)
	b.waitStatus(t, dead.Job.ID, idempotency.StatusDead, 20*time.Second)
	testenv.Eventually(t, 10*time.Second, func() bool {
		info, err := insp.GetTaskInfo(dead.Job.Queue, dead.Job.ID)
		return err == nil && info.State == asynq.TaskStateArchived
	}, "the dead job's delivery was not archived: the hook's panic made it a retry")
	require.EqualValues(t, 1, deaths.Load())
	require.NotContains(t, log.String(), "handler panicked")
	require.Contains(t, log.String(), "pager unreachable")

	blocked, err := b.client.Enqueue(ctx, hookBlocks.New(order{OrderID: "hook-2"}))
	require.NoError(t, err)
	<-started
	// The ledger only, without asynq's cancel: the renewal finds it.
	_, err = testworker.Ops(t, b.store, nil).Cancel(ctx, blocked.Job.ID, "tester", "hook test")
	require.NoError(t, err)
	select {
	case id := <-cancelled:
		require.Equal(t, blocked.Job.ID, id)
	case <-time.After(10 * time.Second):
		t.Fatal("the renewal never stopped the cancelled run")
	}
	after, err := b.client.Enqueue(ctx, hookAfterOK.New(order{OrderID: "hook-3"}))
	require.NoError(t, err)
	b.waitStatus(t, after.Job.ID, idempotency.StatusSucceeded, 20*time.Second)
	j, err := b.store.Get(ctx, blocked.Job.ID)
	require.NoError(t, err)
	require.Equal(t, idempotency.StatusCancelled, j.Status)
	require.Contains(t, log.String(), "metrics registry gone")
}

var lastTryDoubt = tasks.Define[order]("test:last_try_doubt", tasks.MaxRetry(0), tasks.Key(func(o order) string { return "order:" + o.OrderID }))

// A step whose call ended in doubt on the job's last attempt, and whose
// handler can Verify it, does not need a person to say whether the call
// happened: the dead letter says that a replay settles it, and a replay is
// allowed; the replayed run asks Verify first and does not call again when
// the call did happen. (A step without Verify still waits for a person.)
func TestAStepInDoubtWithVerifyOnTheLastAttemptIsSettledByAReplay(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	var calls, verifies atomic.Int32
	mux := tasks.NewMux()
	tasks.Handle(mux, lastTryDoubt, func(ctx context.Context, o order) error {
		return idempotency.Step(ctx, "call", func(context.Context, string) error {
			// The call went through; its answer was lost.
			calls.Add(1)
			return errors.New("connection reset by peer")
		}, idempotency.Verify(func(context.Context, string) (bool, error) {
			verifies.Add(1)
			return calls.Load() > 0, nil
		}))
	})
	b.startWorker(t, mux, nil)
	res, err := b.client.Enqueue(ctx, lastTryDoubt.New(order{OrderID: "doubt-last"}))
	require.NoError(t, err)
	j := b.waitStatus(t, res.Job.ID, idempotency.StatusDead, 20*time.Second)
	insp := inspector(t, b)
	waitArchived(t, insp, j.Queue, j.ID) // asynq archives it just after the ledger says dead
	require.NotContains(t, j.LastError, "on the next attempt", "there is no next attempt")
	require.Contains(t, j.LastError, "replay")
	steps, err := b.store.Steps(ctx, res.Job.ID)
	require.NoError(t, err)
	require.Len(t, steps, 1)
	require.Equal(t, "started", steps[0].Status)
	require.True(t, steps[0].Verifiable)

	// With asynq's archived copy removed, as the CLI and dashboard do; without
	// it the replay waits for the reconciler (up to 15 s).
	_, err = testworker.Ops(t, b.store, insp).Replay(ctx, res.Job.ID, "ops", "Verify settles it")
	require.NoError(t, err, "a replay of a job whose step in doubt has Verify")
	j = b.waitStatus(t, res.Job.ID, idempotency.StatusSucceeded, 20*time.Second)
	require.EqualValues(t, 1, calls.Load(), "the call was made again")
	require.EqualValues(t, 1, verifies.Load())
	steps, err = b.store.Steps(ctx, res.Job.ID)
	require.NoError(t, err)
	require.Equal(t, "done", steps[0].Status)
}

var noVerifyNow = tasks.Define[order]("test:no_verify_now", tasks.MaxRetry(0), tasks.Key(func(o order) string { return "order:" + o.OrderID }))

// A step in doubt that an earlier build could Verify, met by a handler that
// cannot (Verify removed, or an older binary in a rolling deploy), waits
// for a person: it is no longer offered to a replay, which would only die
// on it again.
func TestAStepInDoubtWithoutVerifyNowWaitsForAPerson(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	var calls atomic.Int32
	mux := tasks.NewMux()
	tasks.Handle(mux, noVerifyNow, func(ctx context.Context, o order) error {
		return idempotency.Step(ctx, "call", func(context.Context, string) error { calls.Add(1); return nil })
	})
	res, err := b.client.Enqueue(ctx, noVerifyNow.New(order{OrderID: "was-verifiable"}, tasks.Delay(2*time.Second)))
	require.NoError(t, err)
	_, err = b.pool.Exec(ctx, `INSERT INTO keel_steps (job_id, name, status, verifiable) VALUES ($1, 'call', 'started', true)`, res.Job.ID)
	require.NoError(t, err)
	b.startWorker(t, mux, nil)
	b.waitStatus(t, res.Job.ID, idempotency.StatusDead, 20*time.Second)
	require.Zero(t, calls.Load(), "a call in doubt is never made again blindly")
	steps, err := b.store.Steps(ctx, res.Job.ID)
	require.NoError(t, err)
	require.False(t, steps[0].Verifiable)
	_, err = checkReplay(t, b.store, res.Job.ID)
	require.ErrorIs(t, err, inspect.ErrStepsInDoubt)
}

// Which run of a job that crashed runs alone on its worker, and when such
// a job is retired as a poison job: only for a crash of a run recorded as
// alone. The rows are set as the ledger holds them after each history
// (max_retry 1); the claim is a guard round's.
func TestACrashedJobsLastRunRunsAloneBeforeItIsRetired(t *testing.T) {
	for _, tc := range []struct {
		name                                       string
		attempts, crashes, run, soloRun, extraRuns int
		running                                    bool // its last run ended without an outcome
		wantExhausted, wantAlone                   bool
		wantAttempt, wantExtra, wantCrashes        int
		wantWaited                                 time.Duration // the lease a death at the gate lost
	}{
		{name: "first run crashed: the last runs alone", attempts: 1, run: 1, soloRun: -1, running: true,
			wantAlone: true, wantAttempt: 2, wantCrashes: 1},
		{name: "never crashed: the last runs as any other", attempts: 1, run: 1, soloRun: -1, wantAttempt: 2},
		{name: "crashed long ago: the last runs alone", attempts: 1, crashes: 1, run: 4, soloRun: -1,
			wantAlone: true, wantAttempt: 2, wantCrashes: 1},
		{name: "the first crash, at the last run: one run more, alone", attempts: 2, run: 2, soloRun: -1, running: true,
			wantAlone: true, wantAttempt: 3, wantExtra: 1, wantCrashes: 1},
		{name: "died waiting to run alone: costs nothing but the time", attempts: 2, crashes: 1, run: 2, soloRun: -1, running: true,
			wantAlone: true, wantAttempt: 2, wantCrashes: 1, wantWaited: executor.DefaultLease},
		{name: "died waiting to run alone many times: still not retired", attempts: 2, crashes: 1, run: 40, soloRun: -1, running: true,
			wantAlone: true, wantAttempt: 2, wantCrashes: 1, wantWaited: executor.DefaultLease},
		{name: "crashed while it ran alone: retired", attempts: 2, crashes: 1, run: 2, soloRun: 2, running: true,
			wantExhausted: true},
		{name: "the extra run died waiting: costs nothing but the time", attempts: 3, crashes: 1, run: 3, soloRun: -1, extraRuns: 1,
			running: true, wantAlone: true, wantAttempt: 3, wantExtra: 1, wantCrashes: 1, wantWaited: executor.DefaultLease},
		{name: "the extra run crashed alone: retired", attempts: 3, crashes: 1, run: 3, soloRun: 3, extraRuns: 1,
			running: true, wantExhausted: true},
		{name: "an older keel's run crashed (run 0, never recorded alone)", attempts: 2, run: 0, soloRun: -1, running: true,
			wantAlone: true, wantAttempt: 3, wantExtra: 1, wantCrashes: 1},
		{name: "budget used by failures: retired", attempts: 2, run: 2, soloRun: -1, wantExhausted: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := setup(t)
			ctx := context.Background()
			res, err := b.client.Enqueue(ctx, poison.New(order{OrderID: "history"}))
			require.NoError(t, err)
			status, lease := "failed", "NULL"
			if tc.running {
				status, lease = "running", "now() - interval '1 second'"
			}
			_, err = b.pool.Exec(ctx, `UPDATE keel_jobs SET status = $2, lease_until = `+lease+`,
				lease_holder = CASE WHEN $2 = 'running' THEN 'a-dead-worker' END,
				attempts = $3, crashes = $4, run = $5, solo_run = $6, extra_runs = $7 WHERE id = $1`,
				res.Job.ID, status, tc.attempts, tc.crashes, tc.run, tc.soloRun, tc.extraRuns)
			require.NoError(t, err)
			g := executor.NewGuard(b.store, executor.GuardConfig{Holder: "next-worker"})
			defer g.Close()
			if tc.wantExhausted {
				exhausted, err := g.ClaimExhaustedForTest(ctx, res.Job.ID)
				require.NoError(t, err)
				require.True(t, exhausted, "the job was not to be retired")
				return
			}
			r, err := g.ClaimForTest(ctx, res.Job.ID)
			require.NoError(t, err)
			require.Equal(t, tc.wantAlone, r.Alone, "must it run alone")
			require.Equal(t, tc.wantAttempt, r.Attempt)
			got, err := b.store.Get(ctx, res.Job.ID)
			require.NoError(t, err)
			require.Equal(t, tc.wantExtra, got.ExtraRuns)
			require.Equal(t, tc.wantCrashes, b.count(t, `SELECT crashes FROM keel_jobs WHERE id = $1`, res.Job.ID))
			require.Equal(t, int(tc.wantWaited.Milliseconds()), b.count(t, `SELECT waited_ms FROM keel_jobs WHERE id = $1`, res.Job.ID))
			require.Equal(t, tc.run+1, b.count(t, `SELECT run FROM keel_jobs WHERE id = $1`, res.Job.ID))
		})
	}
}

// A job no keel of this version has claimed has solo_run -1 (the column's
// default): a crash under an older keel is never taken for one while it
// ran alone.
func TestARowAnOlderKeelRanIsNotTakenForOneThatRanAlone(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	res, err := b.client.Enqueue(ctx, oneShot.New(order{OrderID: "legacy"}))
	require.NoError(t, err)
	_, err = b.pool.Exec(ctx, `UPDATE keel_jobs SET status = 'running', lease_holder = 'old-binary', last_holder = 'old-binary',
		lease_until = now() - interval '1 second', attempts = 1 WHERE id = $1`, res.Job.ID)
	require.NoError(t, err)
	g := executor.NewGuard(b.store, executor.GuardConfig{Holder: "new-binary"})
	defer g.Close()
	r, err := g.ClaimForTest(ctx, res.Job.ID)
	require.NoError(t, err)
	require.True(t, r.Alone)
}

var (
	gateNeighbour = tasks.Define[order]("test:gate_neighbour", tasks.MaxRetry(0), tasks.Key(func(o order) string { return o.OrderID }))
	// gateSuspect needs 1 s of its 5 s timeout: 4 s to spare for a slow
	// host, less than the neighbour's 4.5 s a wait would eat.
	gateSuspect = tasks.Define[order]("test:gate_suspect", tasks.MaxRetry(0), tasks.Timeout(5*time.Second),
		tasks.Key(func(o order) string { return o.OrderID }))
)

// A last run that must run alone and waits for a neighbour does not spend
// its own timeout waiting: it waits a fifth of it at most, and is handed
// back uncounted, instead of dying of a timeout its handler would not have
// had.
func TestWaitingToRunAloneDoesNotEatTheRunsTimeout(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	var suspectID string
	mux := tasks.NewMux()
	tasks.Handle(mux, gateNeighbour, func(ctx context.Context, o order) error {
		for b.count(t, `SELECT count(*) FROM keel_jobs WHERE id = $1 AND status = 'running'`, suspectID) == 0 {
			time.Sleep(20 * time.Millisecond)
		}
		// Real time is what is tested: the neighbour runs longer than the
		// suspect's 5 s timeout leaves it to wait for room.
		time.Sleep(4500 * time.Millisecond)
		return nil
	})
	tasks.Handle(mux, gateSuspect, func(ctx context.Context, o order) error {
		select {
		case <-time.After(time.Second):
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	})
	s, err := b.client.Enqueue(ctx, gateSuspect.New(order{OrderID: "suspect"}, tasks.Delay(2*time.Second)))
	require.NoError(t, err)
	suspectID = s.Job.ID
	// As the ledger has it after a crash of the job: its last run runs alone.
	_, err = b.pool.Exec(ctx, `UPDATE keel_jobs SET crashes = 1 WHERE id = $1`, s.Job.ID)
	require.NoError(t, err)
	n, err := b.client.Enqueue(ctx, gateNeighbour.New(order{OrderID: "neighbour"}))
	require.NoError(t, err)
	b.startWorker(t, mux, func(c *server.Config) { c.DelayedTaskCheckInterval = 100 * time.Millisecond })
	b.waitStatus(t, n.Job.ID, idempotency.StatusSucceeded, 20*time.Second)
	var j idempotency.Job
	testenv.Eventually(t, 30*time.Second, func() bool {
		j, err = b.store.Get(ctx, s.Job.ID)
		require.NoError(t, err)
		return j.Status.Terminal() || j.Status == idempotency.StatusDead
	}, "the job never ended")
	require.Equal(t, idempotency.StatusSucceeded, j.Status, "%s: %s", j.ErrorClass, j.LastError)
	require.Equal(t, 1, j.Attempts)
}

// A job whose runs keep dying while they wait to run alone (the worker
// killed under them by other jobs or from outside) is not a poison job,
// but it still ends: each lost lease counts as time waited, and over the
// wait ceiling it dies waited_too_long, never crashed.
func TestRunsThatKeepDyingWhileWaitingToRunAloneEndOverTheWaitCeiling(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	var runs atomic.Int32
	mux := tasks.NewMux()
	tasks.Handle(mux, patient, func(ctx context.Context, o order) error {
		runs.Add(1)
		return nil
	})
	res, err := b.client.Enqueue(ctx, patient.New(order{OrderID: "died-at-the-gate"}))
	require.NoError(t, err)
	// Its last run had to run alone (it crashed before) and its worker
	// died while it waited; its waits are near the ceiling (1.5 s).
	_, err = b.pool.Exec(ctx, `UPDATE keel_jobs SET status = 'running', lease_holder = 'a-dead-worker',
		lease_until = now() - interval '1 second', attempts = 2, crashes = 1, run = 2, waited_ms = 1000 WHERE id = $1`, res.Job.ID)
	require.NoError(t, err)
	b.startWorker(t, mux, func(c *server.Config) { c.Guard.Lease = time.Second })
	j := b.waitStatus(t, res.Job.ID, idempotency.StatusDead, 30*time.Second)
	require.Equal(t, string(retry.ClassWaitedTooLong), j.ErrorClass, j.LastError)
	require.Contains(t, j.LastError, "kept ending with their worker while they waited to run alone")
	require.Zero(t, runs.Load(), "the handler ran")
	require.Equal(t, 1, b.count(t, `SELECT crashes FROM keel_jobs WHERE id = $1`, res.Job.ID))
}
