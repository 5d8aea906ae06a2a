package flow_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/flow"
	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/jobstore"
	"github.com/keeljobs/keel/internal/testenv"
	"github.com/keeljobs/keel/internal/testworker"
	"github.com/keeljobs/keel/server"
	"github.com/keeljobs/keel/tasks"
)

// Report is the payload of the kinds under test.
type Report struct {
	N     int
	Sleep time.Duration
	// Hang keeps the handler running until its worker dies or stops.
	Hang bool
}

var (
	reportKind = tasks.Define[Report]("flowtest:report", tasks.Key(func(r Report) string { return strconv.Itoa(r.N) }))
	mailKind   = tasks.Define[Report]("flowtest:mail", tasks.Key(func(r Report) string { return strconv.Itoa(r.N) }))
)

// reportsRule limits reportKind; the child workers and the tests agree on it.
func reportsRule(concurrency int) flow.Rule {
	return flow.Rule{Name: "reports", Kinds: []string{reportKind.Name()}, Concurrency: concurrency}
}

// Redis keys the report handler writes.
const (
	runningKey    = "flowtest:running"
	maxRunningKey = "flowtest:max-running"
	readyKey      = "flowtest:ready"
	statsKey      = "flowtest:stats"
	slotsKey      = "keel:flow:{reports}:slots"
)

// trackScript counts a handler in and keeps the highest count seen.
var trackScript = redis.NewScript(`
local n = redis.call('INCR', KEYS[1])
if n > tonumber(redis.call('GET', KEYS[2]) or '0') then
  redis.call('SET', KEYS[2], n)
end
return n`)

// reportHandler records each run in the runs table and, in Redis, how many
// handlers run at once. Counting happens inside the flow middleware, so the
// count can only understate the slots held, never overstate them.
func reportHandler(pool *pgxpool.Pool, rdb *redis.Client) func(ctx context.Context, r Report) error {
	return func(ctx context.Context, r Report) error {
		id, _ := idempotency.JobID(ctx)
		if err := trackScript.Run(ctx, rdb, []string{runningKey, maxRunningKey}).Err(); err != nil {
			return err
		}
		defer rdb.Decr(context.WithoutCancel(ctx), runningKey)
		if _, err := pool.Exec(ctx, `INSERT INTO runs (job_id, n, pid) VALUES ($1, $2, $3)`, id, r.N, os.Getpid()); err != nil {
			return err
		}
		if r.Hang {
			<-ctx.Done()
			return ctx.Err()
		}
		select {
		case <-time.After(r.Sleep):
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

type bundle struct {
	redis  asynq.RedisClientOpt
	rdb    *redis.Client
	pool   *pgxpool.Pool
	schema string
	client *tasks.Client
	store  *jobstore.Store
}

// setupRedis gives a test a redis-server of its own, and runs it in
// parallel with the package's other tests.
func setupRedis(t *testing.T) (asynq.RedisClientOpt, *redis.Client) {
	t.Helper()
	t.Parallel()
	opt := asynq.RedisClientOpt{Addr: testenv.StartRedis(t).Addr()}
	rdb := redis.NewClient(&redis.Options{Addr: opt.Addr, DB: opt.DB})
	t.Cleanup(func() { rdb.Close() })
	return opt, rdb
}

// setup adds the ledger, a client and the runs table to setupRedis.
func setup(t *testing.T) *bundle {
	t.Helper()
	b := &bundle{}
	b.redis, b.rdb = setupRedis(t)
	b.pool, b.schema = testenv.PrivatePool(t)
	_, err := b.pool.Exec(context.Background(), `CREATE TABLE runs (job_id text, n int, pid int,
		started_at timestamptz DEFAULT clock_timestamp())`)
	require.NoError(t, err)
	c, err := tasks.NewClient(tasks.ClientConfig{Redis: b.redis, Pool: b.pool})
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	b.client = c
	b.store = jobstore.NewStore(c.Pool())
	return b
}

func newController(t *testing.T, opt asynq.RedisConnOpt, cfg flow.Config) *flow.Controller {
	t.Helper()
	cfg.Redis = opt
	c, err := flow.New(cfg)
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	return c
}

// workerConfig is the keel worker the tests and the child workers run.
func workerConfig(redisOpt asynq.RedisConnOpt, pool *pgxpool.Pool, limits *flow.Controller) server.Config {
	cfg := server.Config{
		Redis:           redisOpt,
		Pool:            pool,
		Concurrency:     10,
		ShutdownTimeout: 2 * time.Second,
		DisableRelay:    true, // the client publishes; nothing is left for a relay
		Middleware:      []func(asynq.Handler) asynq.Handler{limits.Middleware},
		Logger:          slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})),
	}
	cfg.Guard.LedgerRetry = time.Second
	return cfg
}

// startWorker runs an in-process keel worker until the test ends. Register
// the controller's cleanup first, so that it closes after the worker stops.
func (b *bundle) startWorker(t *testing.T, mux *tasks.Mux, limits *flow.Controller) {
	t.Helper()
	testworker.RunServer(t, workerConfig(b.redis, b.pool, limits), mux)
}

func (b *bundle) enqueue(t *testing.T, k *tasks.Kind[Report], r Report) string {
	t.Helper()
	res, err := b.client.Enqueue(context.Background(), k.New(r))
	require.NoError(t, err)
	require.True(t, res.Published)
	return res.Job.ID
}

func (b *bundle) waitStatus(t *testing.T, id string, want idempotency.Status, timeout time.Duration) idempotency.Job {
	t.Helper()
	return testworker.WaitStatus(t, b.store, id, want, timeout)
}

func (b *bundle) count(t *testing.T, sql string, args ...any) int {
	t.Helper()
	var n int
	require.NoError(t, b.pool.QueryRow(context.Background(), sql, args...).Scan(&n))
	return n
}

// The child worker: the test binary run again with childEnv set becomes a
// keel worker process limited by reportsRule, until SIGTERM.
const (
	childEnv      = "KEEL_FLOW_TEST_WORKER"
	childLimitEnv = "KEEL_FLOW_TEST_LIMIT"
	childLeaseEnv = "KEEL_FLOW_TEST_LEASE"
	childHoldEnv  = "KEEL_FLOW_TEST_HOLD"
	// The test's Redis address and ledger schema.
	childRedisEnv  = "KEEL_FLOW_TEST_REDIS"
	childSchemaEnv = "KEEL_FLOW_TEST_SCHEMA"
)

func runChildWorker() bool {
	if os.Getenv(childEnv) == "" {
		return false
	}
	if err := childWorker(); err != nil {
		fmt.Fprintln(os.Stderr, "flow test worker:", err)
		os.Exit(1)
	}
	return true
}

func childWorker() error {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	// The test holds our stdin open: if it dies, so do we.
	go func() {
		_, _ = io.Copy(io.Discard, os.Stdin)
		stop()
	}()
	limit, err := strconv.Atoi(os.Getenv(childLimitEnv))
	if err != nil {
		return err
	}
	var lease, hold time.Duration
	if s := os.Getenv(childLeaseEnv); s != "" {
		if lease, err = time.ParseDuration(s); err != nil {
			return err
		}
	}
	if s := os.Getenv(childHoldEnv); s != "" {
		if hold, err = time.ParseDuration(s); err != nil {
			return err
		}
	}
	redisOpt := asynq.RedisClientOpt{Addr: os.Getenv(childRedisEnv)}
	rdb := redis.NewClient(&redis.Options{Addr: redisOpt.Addr})
	defer rdb.Close()
	pool, err := pgxpool.New(ctx, testenv.URL(os.Getenv(childSchemaEnv)))
	if err != nil {
		return err
	}
	defer pool.Close()
	limits, err := flow.New(flow.Config{Redis: redisOpt, Rules: []flow.Rule{reportsRule(limit)}, Lease: lease, Hold: hold})
	if err != nil {
		return err
	}
	defer limits.Close()
	mux := tasks.NewMux()
	tasks.Handle(mux, reportKind, reportHandler(pool, rdb))
	srv, err := server.New(workerConfig(redisOpt, pool, limits), mux)
	if err != nil {
		return err
	}
	if err := rdb.RPush(ctx, readyKey, os.Getpid()).Err(); err != nil {
		return err
	}
	if err := srv.Run(ctx); err != nil {
		return err
	}
	st := limits.Stats()
	bg := context.Background()
	for field, n := range map[string]uint64{"admitted": st.Admitted, "no_slot": st.NoSlot, "leases_lost": st.LeasesLost} {
		if err := rdb.HIncrBy(bg, statsKey, field, int64(n)).Err(); err != nil {
			return err
		}
	}
	return nil
}

// child is a worker process started by the test.
type child struct {
	cmd  *exec.Cmd
	out  *testenv.SyncBuffer
	done chan struct{}
	err  error
}

// startChild starts a worker process on the test's Redis and ledger, with
// env added to the test's own.
func (b *bundle) startChild(t *testing.T, env ...string) *child {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(append(os.Environ(), childEnv+"=1", childRedisEnv+"="+b.redis.Addr, childSchemaEnv+"="+b.schema), env...)
	c := &child{cmd: cmd, out: &testenv.SyncBuffer{}, done: make(chan struct{})}
	cmd.Stdout, cmd.Stderr = c.out, c.out
	stdin, err := cmd.StdinPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	t.Cleanup(func() { stdin.Close() })
	go func() {
		c.err = cmd.Wait()
		close(c.done)
	}()
	t.Cleanup(func() {
		c.stop(t)
		if t.Failed() {
			t.Logf("worker %d output:\n%s", cmd.Process.Pid, c.out.String())
		}
	})
	return c
}

// stop ends the worker with SIGTERM, as a deployment would, and waits.
func (c *child) stop(t *testing.T) {
	t.Helper()
	select {
	case <-c.done:
		return
	default:
	}
	_ = c.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-c.done:
		require.NoError(t, c.err, "worker %d did not stop cleanly", c.cmd.Process.Pid)
	case <-time.After(20 * time.Second):
		_ = c.cmd.Process.Kill()
		<-c.done
		t.Errorf("worker %d ignored SIGTERM", c.cmd.Process.Pid)
	}
}

// kill ends the worker with SIGKILL: nothing of it runs any more.
func (c *child) kill(t *testing.T) {
	t.Helper()
	require.NoError(t, c.cmd.Process.Kill())
	<-c.done
}

// waitReady waits until n workers have started.
func (b *bundle) waitReady(t *testing.T, n int64) {
	t.Helper()
	testenv.Eventually(t, 30*time.Second, func() bool {
		got, err := b.rdb.LLen(context.Background(), readyKey).Result()
		require.NoError(t, err)
		return got >= n
	}, "%d workers never started", n)
}
