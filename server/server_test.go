package server_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/testenv"
	"github.com/keeljobs/keel/internal/testworker"
	"github.com/keeljobs/keel/metrics"
	"github.com/keeljobs/keel/retry"
	"github.com/keeljobs/keel/server"
	"github.com/keeljobs/keel/tasks"
)

type order struct {
	OrderID string `json:"order_id"`
	Amount  int    `json:"amount"`
}

var (
	charge = tasks.Define[order]("test:charge", tasks.Queue("critical"),
		tasks.Key(func(o order) string { return "order:" + o.OrderID }))
	remind = tasks.Define[order]("test:remind",
		tasks.Key(func(o order) string { return "remind:" + o.OrderID }))
)

func TestEnqueuedJobRunsWithItsPayload(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	type run struct {
		id    string
		order order
	}
	runs := make(chan run, 10)
	mux := tasks.NewMux()
	tasks.Handle(mux, charge, func(ctx context.Context, o order) error {
		id, _ := idempotency.JobID(ctx)
		runs <- run{id, o}
		return nil
	})

	direct, err := b.client.Enqueue(ctx, charge.New(order{OrderID: "1", Amount: 250}))
	require.NoError(t, err)
	require.True(t, direct.Published)
	// Enqueued inside a transaction: the worker's own relay publishes it.
	var viaTx *tasks.Result
	require.NoError(t, pgx.BeginFunc(ctx, b.pool, func(tx pgx.Tx) error {
		viaTx, err = b.client.EnqueueTx(ctx, tx, charge.New(order{OrderID: "2", Amount: 99}))
		return err
	}))

	b.startWorker(t, mux, nil)
	got := map[string]order{}
	for range 2 {
		select {
		case r := <-runs:
			got[r.id] = r.order
		case <-time.After(15 * time.Second):
			t.Fatalf("handler ran %d of 2 times", len(got))
		}
	}
	require.Equal(t, map[string]order{
		direct.Job.ID: {OrderID: "1", Amount: 250},
		viaTx.Job.ID:  {OrderID: "2", Amount: 99},
	}, got)
	for _, id := range []string{direct.Job.ID, viaTx.Job.ID} {
		j := b.waitStatus(t, id, idempotency.StatusSucceeded, 10*time.Second)
		require.Equal(t, 1, j.Attempts)
		require.NotNil(t, j.FinishedAt)
	}
}

func TestDelayedJobDoesNotRunBeforeItsTime(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	type start struct {
		key string
		at  time.Time
	}
	starts := make(chan start, 10)
	mux := tasks.NewMux()
	tasks.Handle(mux, remind, func(ctx context.Context, o order) error {
		starts <- start{o.OrderID, time.Now()}
		return nil
	})

	const delay = 2 * time.Second
	enqueuedAt := time.Now()
	delayed, err := b.client.Enqueue(ctx, remind.New(order{OrderID: "later"}, tasks.Delay(delay)))
	require.NoError(t, err)
	_, err = b.client.Enqueue(ctx, remind.New(order{OrderID: "now"}))
	require.NoError(t, err)
	b.startWorker(t, mux, nil)

	var order []start
	for range 2 {
		select {
		case s := <-starts:
			order = append(order, s)
		case <-time.After(20 * time.Second):
			t.Fatalf("only %d of 2 jobs ran: %v", len(order), order)
		}
	}
	// The worker was running while the delayed job waited.
	require.Equal(t, "now", order[0].key)
	require.Equal(t, "later", order[1].key)
	require.False(t, order[1].at.Before(enqueuedAt.Add(delay)),
		"delayed job started %s after enqueue, before its %s delay", order[1].at.Sub(enqueuedAt), delay)
	b.waitStatus(t, delayed.Job.ID, idempotency.StatusSucceeded, 10*time.Second)
}

var slotKind = tasks.Define[slot]("test:slot", tasks.Key(func(s slot) string { return fmt.Sprintf("%s:%d", s.Queue, s.N) }))

type slot struct {
	Queue string `json:"queue"`
	N     int    `json:"n"`
}

// fill enqueues n jobs on each queue, many at a time.
func (b *bundle) fill(t *testing.T, queues []string, n int) {
	t.Helper()
	ctx := context.Background()
	work := make(chan *tasks.Task)
	var wg sync.WaitGroup
	var failed atomic.Value
	for range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for task := range work {
				res, err := b.client.Enqueue(ctx, task)
				if err == nil && !res.Published {
					err = errors.New("not published")
				}
				if err != nil {
					failed.Store(err)
				}
			}
		}()
	}
	for i := range n {
		for _, q := range queues {
			work <- slotKind.New(slot{Queue: q, N: i}, tasks.Queue(q))
		}
	}
	close(work)
	wg.Wait()
	if err, _ := failed.Load().(error); err != nil {
		t.Fatal(err)
	}
	for _, q := range queues {
		info, err := b.insp.GetQueueInfo(q)
		require.NoError(t, err)
		require.Equal(t, n, info.Pending, "queue %s", q)
	}
}

// recorder notes the queue of each job it runs, up to limit jobs.
type recorder struct {
	mu    sync.Mutex
	limit int
	seen  []string
	full  chan struct{}
}

func newRecorder(limit int) *recorder { return &recorder{limit: limit, full: make(chan struct{})} }

func (r *recorder) handler() *tasks.Mux {
	mux := tasks.NewMux()
	tasks.Handle(mux, slotKind, func(ctx context.Context, s slot) error {
		q, _ := asynq.GetQueueName(ctx)
		if q != s.Queue {
			return fmt.Errorf("job for %s delivered from %s", s.Queue, q)
		}
		r.mu.Lock()
		defer r.mu.Unlock()
		if len(r.seen) < r.limit {
			r.seen = append(r.seen, q)
			if len(r.seen) == r.limit {
				close(r.full)
			}
		}
		return nil
	})
	return mux
}

func (r *recorder) wait(t *testing.T, timeout time.Duration) []string {
	t.Helper()
	select {
	case <-r.full:
	case <-time.After(timeout):
		r.mu.Lock()
		defer r.mu.Unlock()
		t.Fatalf("only %d of %d jobs ran", len(r.seen), r.limit)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]string(nil), r.seen...)
}

// With every queue full, each fetch picks a queue with probability
// weight/total (asynq shuffles a list holding each name weight times and
// takes the first non-empty queue), so the first n jobs of one worker are a
// multinomial sample with p = 0.6, 0.3, 0.1.
func TestWeightedQueuesShareFetchesByWeight(t *testing.T) {
	b := setup(t)
	queues := []string{"critical", "default", "low"}
	b.fill(t, queues, 300)

	const n = 300
	rec := newRecorder(n)
	b.startWorker(t, rec.handler(), func(c *server.Config) {
		c.Concurrency = 1 // one fetch per job, in order
		c.Queues = server.DefaultQueues()
		c.DisableRelay = true
	})
	seen := rec.wait(t, 60*time.Second)

	share := map[string]float64{}
	for _, q := range seen {
		share[q] += 1.0 / n
	}
	t.Logf("shares of the first %d jobs: %v", n, share)
	// Bounds are more than 5 standard deviations (sqrt(p(1-p)/n): 0.028,
	// 0.026, 0.017) from the expected share on each side.
	require.InDelta(t, 0.6, share["critical"], 0.15)
	require.InDelta(t, 0.3, share["default"], 0.14)
	require.InDelta(t, 0.1, share["low"], 0.09)
}

func TestStrictPriorityDrainsHigherQueuesFirst(t *testing.T) {
	b := setup(t)
	queues := []string{"critical", "default", "low"}
	const each = 30
	b.fill(t, queues, each)

	rec := newRecorder(3 * each)
	b.startWorker(t, rec.handler(), func(c *server.Config) {
		c.Concurrency = 1
		c.StrictPriority = true
		c.DisableRelay = true
	})
	seen := rec.wait(t, 60*time.Second)

	rank := map[string]int{"critical": 0, "default": 1, "low": 2}
	for i := 1; i < len(seen); i++ {
		require.LessOrEqual(t, rank[seen[i-1]], rank[seen[i]], "job %d came from %s after one from %s: %v", i, seen[i], seen[i-1], seen)
	}
	require.Equal(t, "low", seen[len(seen)-1])
}

// A handler that panics must not take the worker down, and its job must be
// recorded as failed and then dead — not left running under a lease.
func TestPanickingHandlerIsRecordedFailedThenDead(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	var calls atomic.Int32
	after := make(chan struct{})
	mux := tasks.NewMux()
	tasks.Handle(mux, charge, func(ctx context.Context, o order) error {
		calls.Add(1)
		var m map[string]int
		m[o.OrderID]++ // nil map: a runtime panic
		return nil
	})
	tasks.Handle(mux, remind, func(context.Context, order) error { close(after); return nil })
	res, err := b.client.Enqueue(ctx, charge.New(order{OrderID: "panics"}, tasks.MaxRetry(1)))
	require.NoError(t, err)
	b.startWorker(t, mux, func(c *server.Config) { c.Logger = quietLogger() })

	j := b.waitStatus(t, res.Job.ID, idempotency.StatusDead, 20*time.Second)
	require.Equal(t, 2, j.Attempts, "one attempt and one retry")
	require.EqualValues(t, 2, calls.Load())
	require.Contains(t, j.LastError, "panicked")
	require.Contains(t, j.LastError, "nil map")
	require.Empty(t, j.LeaseHolder)
	testenv.Eventually(t, 10*time.Second, func() bool {
		info, err := b.insp.GetTaskInfo("critical", res.Job.ID)
		return err == nil && info.State == asynq.TaskStateArchived
	}, "asynq should archive the dead job")

	// The worker survived and runs the next job.
	_, err = b.client.Enqueue(ctx, remind.New(order{OrderID: "after"}))
	require.NoError(t, err)
	select {
	case <-after:
	case <-time.After(10 * time.Second):
		t.Fatal("job after the panic never ran")
	}
}

func TestRecoverTurnsPanicIntoError(t *testing.T) {
	h := server.Recover(quietLogger())(asynq.HandlerFunc(func(context.Context, *asynq.Task) error {
		panic("boom")
	}))
	var err error
	require.NotPanics(t, func() { err = h.ProcessTask(context.Background(), asynq.NewTask("test:panic", nil)) })
	require.ErrorContains(t, err, "panicked")
	require.ErrorContains(t, err, "boom")

	ok := server.Recover(testLogger())(asynq.HandlerFunc(func(context.Context, *asynq.Task) error { return nil }))
	require.NoError(t, ok.ProcessTask(context.Background(), asynq.NewTask("test:fine", nil)))
}

func TestRunRefusesUnmigratedLedger(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	empty := fmt.Sprintf("keel_test_server_empty_%d", os.Getpid())
	cfg, err := testenv.PoolConfig(ctx, empty) // an empty schema
	require.NoError(t, err)
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	defer pool.Close()
	defer pool.Exec(context.Background(), "DROP SCHEMA "+pgx.Identifier{empty}.Sanitize()) //nolint:errcheck // a leftover is recreated by name

	redis := asynq.RedisClientOpt{Addr: testenv.StartRedis(t).Addr()}
	srv, err := server.New(server.Config{Redis: redis, Pool: pool, Logger: testLogger()}, tasks.NewMux())
	require.NoError(t, err)
	runCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	err = srv.Run(runCtx)
	require.ErrorContains(t, err, "keel migrate")
	require.NoError(t, runCtx.Err(), "Run must refuse at once, not wait for the context")
}

// A death is one ERROR line ("keel: job died", with the class and error)
// and the attempt's own line; asynq's "Retry exhausted" for the copy it
// archives says nothing more and is kept to debug.
func TestAJobsDeathIsLoggedOnce(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	var log testenv.SyncBuffer
	mux := tasks.NewMux()
	mux.HandleTask("test:dies", asynq.HandlerFunc(func(context.Context, *asynq.Task) error {
		return retry.Permanent(errors.New("no such mailbox"))
	}))
	res, err := b.client.Enqueue(ctx, tasks.NewRaw("test:dies", []byte(`{}`), "dies-1"))
	require.NoError(t, err)
	b.startWorker(t, mux, func(c *server.Config) { c.Logger = slog.New(slog.NewTextHandler(&log, nil)) })
	testworker.WaitStatus(t, b.store, res.Job.ID, idempotency.StatusDead, 10*time.Second)
	testenv.Eventually(t, 10*time.Second, func() bool {
		info, err := b.insp.GetTaskInfo("default", res.Job.ID)
		return err == nil && info.State == asynq.TaskStateArchived
	}, "asynq did not archive its copy")
	require.Equal(t, 1, strings.Count(log.String(), "keel: job died"), log.String())
	require.NotContains(t, log.String(), "Retry exhausted", "asynq's line at info level or above")
}

// A failed job's ledger row says when it runs again, and that is when
// asynq retries it: `keel status` and the dashboard read run_at.
func TestAFailedJobsNextRetryIsInTheLedger(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	mux := tasks.NewMux()
	tasks.Handle(mux, charge, func(ctx context.Context, o order) error {
		return retry.Transient(errors.New("provider down"))
	})
	res, err := b.client.Enqueue(ctx, charge.New(order{OrderID: "retries-later"}))
	require.NoError(t, err)
	b.startWorker(t, mux, func(c *server.Config) {
		c.Logger = quietLogger()
		c.Retry.Base, c.Retry.Cap = time.Hour, 2*time.Hour // far from now, and from the enqueue's run_at
	})
	j := b.waitStatus(t, res.Job.ID, idempotency.StatusFailed, 20*time.Second)
	var info *asynq.TaskInfo
	testenv.Eventually(t, 10*time.Second, func() bool {
		info, err = b.insp.GetTaskInfo("critical", res.Job.ID)
		return err == nil && info.State == asynq.TaskStateRetry
	}, "asynq should hold the job for a retry")
	// Backoff from one hour, jittered by up to a fifth either way.
	require.Greater(t, time.Until(j.RunAt), 30*time.Minute, "the ledger's run_at is the retry's time")
	// asynq keeps whole seconds.
	require.WithinDuration(t, info.NextProcessAt, j.RunAt, 2*time.Second, "the ledger and asynq agree on the retry's time")
}

var logged = tasks.Define[order]("test:logged", tasks.Key(func(o order) string { return "logged:" + o.OrderID }))

// attemptLine is the worker's per-attempt log line (server.Log) of task id:
// its message.
func attemptLine(log *testenv.SyncBuffer, id string, nth int) (string, bool) {
	n := 0
	for line := range strings.SplitSeq(log.String(), "\n") {
		if !strings.Contains(line, "task_id="+id) {
			continue
		}
		if _, msg, ok := strings.Cut(line, ` msg="`); ok {
			if msg, _, ok = strings.Cut(msg, `"`); ok && (strings.HasPrefix(msg, "keel: job") || strings.HasPrefix(msg, "keel: duplicate")) {
				if n++; n == nth {
					return msg, true
				}
			}
		}
	}
	return "", false
}

// The worker's line per attempt says what keel did with the delivery, not
// what the handler returned: a run stopped because its job was cancelled is
// not "done", a run a deploy cut short is not "failed", and a delivery of a
// finished job, acknowledged without running anything, is not "done" again.
func TestTheAttemptLogLineSaysWhatKeelDid(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	log := &testenv.SyncBuffer{}
	started := make(chan string, 4)
	ranOut := make(chan struct{}) // closed once the worker's Run returned
	mux := tasks.NewMux()
	tasks.Handle(mux, logged, func(ctx context.Context, o order) error {
		if o.OrderID == "quick" {
			return nil
		}
		id, _ := idempotency.JobID(ctx)
		started <- id
		<-ctx.Done()
		if o.OrderID == "cut late" {
			// Slow to notice: the worker gave its run back at Close first.
			<-ranOut
		}
		return ctx.Err()
	})
	cfg := server.Config{Redis: b.redis, Pool: b.pool, Concurrency: 4, ShutdownTimeout: time.Second,
		Logger: slog.New(slog.NewTextHandler(log, &slog.HandlerOptions{Level: slog.LevelDebug}))}
	cfg.Guard.Lease = time.Second // the renewal finds a cancel within 200 ms
	// And the worker's metrics count the same: neither the cancelled run
	// nor the interrupted one is a failed attempt (a deploy would fire the
	// failure alerts).
	reg := prometheus.NewRegistry()
	wm, err := metrics.NewWorker(metrics.WorkerConfig{Registerer: reg})
	require.NoError(t, err)
	cfg.Middleware = append(cfg.Middleware, wm.Middleware)
	srv, err := server.New(cfg, mux)
	require.NoError(t, err)
	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	done := make(chan error, 1)
	go func() { done <- srv.Run(runCtx) }()

	// Cancelled while it ran, through the ledger alone: the renewal stops it.
	cancelled, err := b.client.Enqueue(ctx, logged.New(order{OrderID: "cancelled"}))
	require.NoError(t, err)
	require.Equal(t, cancelled.Job.ID, <-started)
	_, err = testworker.Ops(t, b.store, nil).Cancel(ctx, cancelled.Job.ID, "tester", "log line")
	require.NoError(t, err)
	testenv.Eventually(t, 10*time.Second, func() bool { _, ok := attemptLine(log, cancelled.Job.ID, 1); return ok }, "no line for the cancelled run")
	msg, _ := attemptLine(log, cancelled.Job.ID, 1)
	require.Equal(t, "keel: job cancelled", msg)

	// Finished, then delivered again (asynq's copy of it once more).
	quick, err := b.client.Enqueue(ctx, logged.New(order{OrderID: "quick"}))
	require.NoError(t, err)
	b.waitStatus(t, quick.Job.ID, idempotency.StatusSucceeded, 10*time.Second)
	testenv.Eventually(t, 10*time.Second, func() bool { _, ok := attemptLine(log, quick.Job.ID, 1); return ok }, "no line for the quick run")
	ac := asynq.NewClient(b.redis)
	defer ac.Close()
	_, err = ac.Enqueue(asynq.NewTask(logged.Name(), []byte(`{"order_id":"quick"}`)), asynq.TaskID(quick.Job.ID), asynq.Queue(quick.Job.Queue))
	require.NoError(t, err)
	testenv.Eventually(t, 10*time.Second, func() bool { _, ok := attemptLine(log, quick.Job.ID, 2); return ok }, "no line for the second delivery")
	msg, _ = attemptLine(log, quick.Job.ID, 1)
	require.Equal(t, "keel: job done", msg)
	msg, _ = attemptLine(log, quick.Job.ID, 2)
	require.Equal(t, "keel: duplicate delivery acknowledged", msg)

	// A poison job, retired at its delivery: nothing ran, and it is dead.
	poison, err := b.client.Enqueue(ctx, logged.New(order{OrderID: "poison"}, tasks.MaxRetry(0), tasks.Delay(2*time.Second)))
	require.NoError(t, err)
	_, err = b.pool.Exec(ctx, `UPDATE keel_jobs SET attempts = 1, crashes = 1 WHERE id = $1`, poison.Job.ID)
	require.NoError(t, err)
	testenv.Eventually(t, 15*time.Second, func() bool { _, ok := attemptLine(log, poison.Job.ID, 1); return ok }, "no line for the poison job")
	msg, _ = attemptLine(log, poison.Job.ID, 1)
	require.Equal(t, "keel: job retired as a poison job", msg)

	// Cut short by the worker's shutdown: one handler returns as soon as
	// its context ends, one only after the worker's Close gave its run
	// back (a handler slow to notice, or a busy host).
	cut, err := b.client.Enqueue(ctx, logged.New(order{OrderID: "cut"}))
	require.NoError(t, err)
	late, err := b.client.Enqueue(ctx, logged.New(order{OrderID: "cut late"}))
	require.NoError(t, err)
	require.ElementsMatch(t, []string{cut.Job.ID, late.Job.ID}, []string{<-started, <-started})
	stop()
	require.NoError(t, <-done)
	close(ranOut)
	for _, id := range []string{cut.Job.ID, late.Job.ID} {
		// asynq stops waiting for a handler at its ShutdownTimeout; the
		// handler's goroutine, and so the line, can end a moment after Run.
		testenv.Eventually(t, 10*time.Second, func() bool { _, ok := attemptLine(log, id, 1); return ok }, "no line for the run the shutdown cut")
		msg, _ = attemptLine(log, id, 1)
		require.Equal(t, "keel: job interrupted by shutdown", msg, "job %s", id)
		j, err := b.store.Get(ctx, id)
		require.NoError(t, err)
		require.Equal(t, idempotency.StatusPending, j.Status)
	}

	counted := map[string]float64{}
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			counted[mf.GetName()] += m.GetCounter().GetValue()
		}
	}
	require.Equal(t, 1.0, counted["keel_jobs_processed_total"], "attempts processed: only the quick one")
	require.Equal(t, 1.0, counted["keel_jobs_succeeded_total"])
	require.Zero(t, counted["keel_jobs_failed_total"], "a cancelled or interrupted run counted as a failed attempt")
}

type secret struct {
	ID    string `json:"id"`
	Token string `json:"token"`
}

func redacted(name string) *tasks.Kind[secret] {
	return tasks.Define[secret](name, tasks.MaxRetry(0), tasks.Key(func(s secret) string { return s.ID }),
		tasks.Summary(func(s secret) string { return "secret " + s.ID }))
}

var (
	listedKind  = redacted("test:listed")    // in Config.Kinds, handled untyped
	handledKind = redacted("test:handled")   // given to tasks.Handle
	strayKind   = redacted("test:elsewhere") // declared in the process, not the worker's
)

// A dead job keeps its kind's Summary when the worker's Config.Kinds holds
// the kind or its mux handles it, and the start of its payload otherwise,
// whatever else the process declares.
func TestDeadJobsAreSummarizedByTheWorkersKinds(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	dies := func(context.Context, secret) error { return retry.Permanent(errors.New("no")) }
	mux := tasks.NewMux()
	mux.HandleTask(listedKind.Name(), listedKind.Handler(dies))
	tasks.Handle(mux, handledKind, dies)
	mux.HandleTask(strayKind.Name(), strayKind.Handler(dies))
	b.startWorker(t, mux, func(c *server.Config) { c.Kinds, c.Logger = tasks.NewKinds(listedKind), quietLogger() })
	for k, want := range map[*tasks.Kind[secret]]string{
		listedKind:  "secret 1",
		handledKind: "secret 1",
		strayKind:   `{"id":"1","token":"t0k3n"}`,
	} {
		res, err := b.client.Enqueue(ctx, k.New(secret{ID: "1", Token: "t0k3n"}))
		require.NoError(t, err)
		j := b.waitStatus(t, res.Job.ID, idempotency.StatusDead, 20*time.Second)
		require.Equal(t, want, j.PayloadSummary, k.Name())
	}
}

// Two different kinds of one name, one in Config.Kinds and one handled by
// the mux, are a program's mistake that New reports, not a panic.
func TestNewRefusesTwoKindsOfOneName(t *testing.T) {
	b := setup(t)
	mine := redacted("test:twice")
	other := redacted("test:twice")
	mux := tasks.NewMux()
	tasks.Handle(mux, other, func(context.Context, secret) error { return nil })
	cfg := server.Config{Redis: b.redis, Pool: b.pool, Kinds: tasks.NewKinds(mine)}
	require.NotPanics(t, func() {
		_, err := server.New(cfg, mux)
		require.ErrorContains(t, err, `two kinds are named "test:twice"`)
	})
}
