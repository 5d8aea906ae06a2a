package scaleout_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
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

	flowlimit "github.com/keeljobs/keel/flow"
	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/testenv"
	"github.com/keeljobs/keel/internal/testworker"
	"github.com/keeljobs/keel/outbox"
	"github.com/keeljobs/keel/redisurl"
	"github.com/keeljobs/keel/scheduler"
	"github.com/keeljobs/keel/server"
	"github.com/keeljobs/keel/tasks"
	"github.com/keeljobs/keel/web"
)

type tick struct{}

var (
	// limited runs under a concurrency and a rate limit (package flow).
	limited = tasks.Define[job]("scale:limited", tasks.Queue("default"), tasks.Key(func(j job) string { return fmt.Sprint(j.N) }))
	// ticked is what the scheduler enqueues; its business key is the tick's.
	ticked = tasks.Define[tick]("scale:tick", tasks.Queue("critical"), tasks.Key(func(tick) string { return "" }))
)

// lostQueue is where the writes a failover drops are made: the queue of the
// master that is killed.
const lostQueue = "low"

// failoverTarget is a Redis deployment whose master can be killed.
type failoverTarget struct {
	url string
	// isolate cuts the master to be killed off from its replicas: writes made
	// after it reach that master alone, as the last writes before a crash do
	// under asynchronous replication.
	isolate func(t *testing.T)
	// kill SIGKILLs that master and lets its replicas run again.
	kill func(t *testing.T)
	// promoted reports whether a replica has taken over.
	promoted func(ctx context.Context) bool
}

// failoverFigures are one run's measurements, from the kill.
type failoverFigures struct {
	promoted, firstJob, lostBack time.Duration
}

func (f failoverFigures) String() string {
	return fmt.Sprintf("kill to promotion %s, to first job finished on the new master %s, to the dropped jobs republished and run %s",
		f.promoted.Round(10*time.Millisecond), f.firstJob.Round(10*time.Millisecond), f.lostBack.Round(100*time.Millisecond))
}

// failoverRun drives keel through a master's death: two workers (relays
// polling every 100ms, reconcilers and rescuers at their defaults), a flow
// limit, a scheduler ticking every second and the dashboard, all on target's
// URL, while jobs are enqueued through Enqueue and EnqueueTx. Jobs published after isolate
// are lost with the master; the reconciler must publish them again from the
// ledger. Every job must run once and succeed, and the scheduler, the flow
// limit and the dashboard must work on the new master.
func failoverRun(t *testing.T, target failoverTarget) failoverFigures {
	opt, err := redisurl.Parse(target.url)
	require.NoError(t, err)
	pool, _ := testenv.PrivatePool(t)
	ctx := context.Background()
	_, err = pool.Exec(ctx, `CREATE TABLE fo_effects (job_id text NOT NULL, kind text NOT NULL, worker int NOT NULL)`)
	require.NoError(t, err)

	var killedAt atomic.Pointer[time.Time]
	var firstAfterKill atomic.Pointer[time.Time]
	var runsMu sync.Mutex
	runs := map[string]int{}
	mux := func(worker int) *tasks.Mux {
		m := tasks.NewMux()
		effect := func(ctx context.Context, kind string) error {
			started := time.Now()
			id, _ := idempotency.JobID(ctx)
			runsMu.Lock()
			runs[id]++
			runsMu.Unlock()
			err := idempotency.InTx(ctx, func(tx pgx.Tx) error {
				_, err := tx.Exec(ctx, `INSERT INTO fo_effects (job_id, kind, worker) VALUES ($1, $2, $3)`, id, kind, worker)
				return err
			})
			// A handler of the killed master's queue that started after the
			// kill got its task from the new master: the old one was gone.
			q, _ := asynq.GetQueueName(ctx)
			if k := killedAt.Load(); err == nil && k != nil && q == lostQueue && started.After(*k) {
				now := time.Now()
				firstAfterKill.CompareAndSwap(nil, &now)
			}
			return err
		}
		h := func(ctx context.Context, j job) error { return effect(ctx, "job") }
		for _, k := range []*tasks.Kind[job]{critical, normal, low, limited} {
			tasks.Handle(m, k, h)
		}
		tasks.Handle(m, ticked, func(ctx context.Context, _ tick) error { return effect(ctx, "tick") })
		return m
	}
	rules := []flowlimit.Rule{{Name: "scale-limited", Kinds: []string{limited.Name()}, Concurrency: 3, Rate: 200}}
	var limits []*flowlimit.Controller
	for w := range 2 {
		lim, err := flowlimit.New(flowlimit.Config{Redis: opt, Rules: rules})
		require.NoError(t, err)
		// Cleanups run last first: the limits close after the worker stopped.
		t.Cleanup(func() { lim.Close() })
		limits = append(limits, lim)
		testworker.RunServer(t, server.Config{Redis: opt, Pool: pool, Concurrency: 10, ShutdownTimeout: 2 * time.Second,
			Relay:      outbox.RelayConfig{PollInterval: 100 * time.Millisecond},
			Middleware: []func(asynq.Handler) asynq.Handler{lim.Middleware}}, mux(w))
	}

	c, err := tasks.NewClient(tasks.ClientConfig{Redis: opt, Pool: pool})
	require.NoError(t, err)
	defer c.Close()
	sched, err := scheduler.New(scheduler.Config{Client: c, Kinds: tasks.NewKinds(ticked), Entries: []scheduler.Entry{
		{Name: "scale-every-second", Spec: "@every 1s", Kind: ticked.Name()}}, Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	schedCtx, stopSched := context.WithCancel(ctx)
	schedDone := make(chan error, 1)
	go func() { schedDone <- sched.Run(schedCtx) }()
	stopScheduler := sync.OnceFunc(func() {
		stopSched()
		require.NoError(t, <-schedDone)
	})
	defer stopScheduler()

	dash := startDashboard(t, opt, pool)

	// Enqueue retries a call that failed while Redis was failing over, as a
	// caller would; the ledger keeps the retry to one job.
	deadline := time.Now().Add(90 * time.Second)
	enqueue := func(kind *tasks.Kind[job], n int, opts ...tasks.Option) string {
		for {
			var res *tasks.Result
			var err error
			if n%2 == 0 {
				res, err = c.Enqueue(ctx, kind.New(job{N: n}, opts...))
			} else {
				err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
					res, err = c.EnqueueTx(ctx, tx, kind.New(job{N: n}, opts...))
					return err
				})
			}
			if err == nil {
				return res.Job.ID
			}
			require.True(t, time.Now().Before(deadline), "enqueue of job %d still failing: %v", n, err)
			time.Sleep(50 * time.Millisecond)
		}
	}
	kinds := []*tasks.Kind[job]{critical, normal, low, limited}
	n := 0
	enqueueSome := func(count int) {
		for range count {
			enqueue(kinds[n%len(kinds)], n)
			n++
		}
	}
	succeeded := func(where string, args ...any) int {
		var k int
		require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM keel_jobs WHERE status = 'succeeded' AND `+where, args...).Scan(&k))
		return k
	}

	enqueueSome(100)
	testenv.Eventually(t, 30*time.Second, func() bool { return succeeded("kind <> $1", ticked.Name()) >= 50 },
		"the workers never got going")
	dash.check(t, time.Now().Add(10*time.Second))

	// The last writes before the crash: delayed jobs only the old master
	// holds, so they are still in Redis when it dies. Enqueue publishes
	// them itself (EnqueueTx would leave it to a relay, maybe after the kill).
	target.isolate(t)
	var lost []string
	for range 10 {
		res, err := c.Enqueue(ctx, low.New(job{N: n}, tasks.Delay(time.Second)))
		require.NoError(t, err)
		require.True(t, res.Published, "job %d did not reach the isolated master", n)
		lost = append(lost, res.Job.ID)
		n++
	}
	target.kill(t)
	kill := time.Now()
	killedAt.Store(&kill)
	t.Logf("master killed with %d jobs enqueued", n)

	// Jobs keep coming while the sentinels or the cluster fail over.
	produced := make(chan struct{})
	var rest int
	go func() {
		defer close(produced)
		for range 100 {
			enqueue(kinds[(n+rest)%len(kinds)], n+rest)
			rest++
			time.Sleep(10 * time.Millisecond)
		}
	}()
	promoteCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	for !target.promoted(promoteCtx) {
		require.NoError(t, promoteCtx.Err(), "no replica took over within 30s")
		time.Sleep(20 * time.Millisecond)
	}
	promotedAt := time.Now()
	var fig failoverFigures
	fig.promoted = promotedAt.Sub(kill)
	t.Logf("promoted after %s", fig.promoted)

	// The failover dropped the isolated writes.
	insp := asynq.NewInspector(opt)
	defer insp.Close()
	missing := 0
	for _, id := range lost {
		if _, err := insp.GetTaskInfo(lostQueue, id); err != nil {
			missing++
		}
	}
	require.Equal(t, len(lost), missing, "the new master holds writes made after the replicas were cut off")

	<-produced
	n += rest
	total := n
	testenv.Eventually(t, 60*time.Second, func() bool { return succeeded("kind <> $1", ticked.Name()) == total },
		"not every job succeeded after the failover (%d enqueued)", total)
	first := firstAfterKill.Load()
	require.NotNil(t, first, "no job of queue %s ran after the kill", lostQueue)
	fig.firstJob = first.Sub(kill)
	var lastLost time.Time
	require.NoError(t, pool.QueryRow(ctx, `SELECT max(finished_at) FROM keel_jobs WHERE id = ANY($1)`, lost).Scan(&lastLost))
	fig.lostBack = lastLost.Sub(kill)
	// The scheduler ticks on the new master.
	testenv.Eventually(t, 20*time.Second, func() bool {
		return succeeded("kind = $1 AND created_at > $2", ticked.Name(), promotedAt) >= 2
	}, "the scheduler did not fire after the failover")
	// The flow limit admits jobs again and its errors stopped: a last batch
	// of limited jobs passes with no new Redis error.
	var errsBefore, admittedBefore uint64
	for _, l := range limits {
		errsBefore += l.Stats().RedisErrors
		admittedBefore += l.Stats().Admitted
	}
	for range 20 {
		enqueue(limited, n)
		n++
	}
	total = n
	testenv.Eventually(t, 30*time.Second, func() bool { return succeeded("kind <> $1", ticked.Name()) == total },
		"the flow-limited jobs enqueued after the failover did not all run")
	var errsAfter, admittedAfter uint64
	for _, l := range limits {
		errsAfter += l.Stats().RedisErrors
		admittedAfter += l.Stats().Admitted
	}
	require.GreaterOrEqual(t, admittedAfter-admittedBefore, uint64(20), "the flow limit did not admit the last jobs")
	require.Equal(t, errsBefore, errsAfter, "the flow limit still fails on the new master")
	dash.check(t, time.Now().Add(20*time.Second))

	stopScheduler()
	// Every job, ticks included, ran once: one effect each, one handler run.
	testenv.Eventually(t, 20*time.Second, func() bool {
		var open int
		require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM keel_jobs WHERE status <> 'succeeded'`).Scan(&open))
		return open == 0
	}, "a tick never succeeded")
	var jobs, effects, distinct int
	require.NoError(t, pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM keel_jobs), (SELECT count(*) FROM fo_effects),
		(SELECT count(DISTINCT job_id) FROM fo_effects)`).Scan(&jobs, &effects, &distinct))
	require.Equal(t, jobs, distinct, "a job without its effect")
	require.Equal(t, jobs, effects, "an effect twice")
	runsMu.Lock()
	for id, r := range runs {
		require.Equal(t, 1, r, "job %s ran %d times", id, r)
	}
	runsMu.Unlock()
	// Every job has succeeded: asynq shows none of them running any more,
	// well before its own recovery (a lease, a recoverer and a retry: about
	// 150 s) would have cleared an acknowledgement the old master lost.
	testenv.Eventually(t, 30*time.Second, func() bool {
		active := 0
		for _, q := range []string{"critical", "default", "low"} {
			if info, err := insp.GetQueueInfo(q); err == nil {
				active += info.Active
			}
		}
		return active == 0
	}, "asynq still shows finished jobs as running")
	return fig
}

// dashboard is the web server on the Redis under test, reached as an
// operator signed in through a proxy header.
type dashboard struct {
	ts *httptest.Server
}

func startDashboard(t *testing.T, opt asynq.RedisConnOpt, pool *pgxpool.Pool) *dashboard {
	t.Helper()
	srv, err := web.New(web.Config{Addr: "127.0.0.1:0", Redis: opt, Pool: pool, ProxyUserHeader: "X-User",
		ProxyOperators: []string{"ops"}, Secret: []byte(strings.Repeat("s", web.MinSecretBytes)),
		SampleInterval: time.Second, Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	t.Cleanup(srv.Close)
	ts := httptest.NewServer(srv.Handler())
	t.Cleanup(ts.Close)
	return &dashboard{ts: ts}
}

// check waits until the overview and asynqmon's queue list (both read
// Redis) answer, listing the test's queues, or deadline passes.
func (d *dashboard) check(t *testing.T, deadline time.Time) {
	t.Helper()
	var last string
	for time.Now().Before(deadline) {
		overview, okOverview := d.get("/")
		queues, okQueues := d.get("/monitoring/api/queues")
		var list struct {
			Queues []struct {
				Queue string `json:"queue"`
			} `json:"queues"`
		}
		if okOverview && okQueues && json.Unmarshal([]byte(queues), &list) == nil && len(list.Queues) >= 3 &&
			strings.Contains(overview, lostQueue) {
			return
		}
		last = queues
		time.Sleep(100 * time.Millisecond)
	}
	t.Fatalf("the dashboard did not answer: last asynqmon reply %.300s", last)
}

func (d *dashboard) get(path string) (string, bool) {
	req, err := http.NewRequest(http.MethodGet, d.ts.URL+path, nil)
	if err != nil {
		return err.Error(), false
	}
	req.Header.Set("X-User", "ops")
	c := &http.Client{Timeout: 5 * time.Second}
	res, err := c.Do(req)
	if err != nil {
		return err.Error(), false
	}
	defer res.Body.Close()
	b, _ := io.ReadAll(res.Body)
	return string(b), res.StatusCode == http.StatusOK
}

// signal sends sig to one of the test's own redis processes.
func signal(t *testing.T, p *redisProc, sig syscall.Signal) {
	t.Helper()
	require.NoError(t, p.cmd.Process.Signal(sig), "signal %v to redis on port %d", sig, p.port)
}

// cutReplicas stops replicas and makes master drop its links to them: the
// replicas cannot reconnect while stopped, so what master is sent next is in
// no replica's stream.
func cutReplicas(t *testing.T, master *redisProc, replicas ...*redisProc) {
	t.Helper()
	for _, r := range replicas {
		signal(t, r, syscall.SIGSTOP)
	}
	c := redis.NewClient(&redis.Options{Addr: master.addr()})
	defer c.Close()
	n, err := c.Do(context.Background(), "CLIENT", "KILL", "TYPE", "replica").Int()
	require.NoError(t, err)
	require.Equal(t, len(replicas), n, "replica links dropped")
}

// killMaster SIGKILLs master and resumes the stopped replicas.
func killMaster(t *testing.T, master *redisProc, replicas ...*redisProc) {
	t.Helper()
	signal(t, master, syscall.SIGKILL)
	for _, r := range replicas {
		signal(t, r, syscall.SIGCONT)
	}
}
