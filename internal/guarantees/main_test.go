// Package guarantees_test attacks keel's promises across its packages with
// real worker processes, a private Redis and its own ledger schema.
package guarantees_test

import (
	"context"
	"os"
	"os/exec"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/jobstore"
	"github.com/keeljobs/keel/internal/testenv"
	"github.com/keeljobs/keel/internal/testworker"
	"github.com/keeljobs/keel/server"
	"github.com/keeljobs/keel/tasks"
)

const (
	// childEnv names the test a child worker runs for; childRedisEnv its
	// Redis address.
	childEnv      = "KEEL_GUARANTEES_CHILD"
	childRedisEnv = "KEEL_GUARANTEES_REDIS"
)

func TestMain(m *testing.M) {
	if testworker.RunChildWorker(childEnv, childWorker) {
		return
	}
	os.Exit(m.Run())
}

// childWorker builds the worker a child process runs: the handlers of the
// test named in childEnv.
func childWorker(pool *pgxpool.Pool) (server.Config, asynq.Handler) {
	cfg := server.Config{
		Redis:           asynq.RedisClientOpt{Addr: os.Getenv(childRedisEnv)},
		Concurrency:     5,
		ShutdownTimeout: time.Second,
	}
	cfg.Retry.Base, cfg.Retry.Cap = time.Second, time.Second
	mux := tasks.NewMux()
	switch os.Getenv(childEnv) {
	case "poison":
		cfg.Guard.Lease = 2 * time.Second
		poisonHandlers(mux, pool)
	case "neighbours":
		cfg.Guard.Lease = 2 * time.Second
		neighbourHandlers(mux, pool)
	case "hung-neighbours":
		cfg.Guard.Lease = 2 * time.Second
		cfg.Guard.TimeoutGrace = 500 * time.Millisecond
		hungNeighbourHandlers(mux, pool)
	case "doomed":
		doomedHandlers(&cfg, mux, pool)
	case "deps":
		cfg.Guard.Lease = 2 * time.Second
		depsHandlers(mux, pool)
	case "kind-pause":
		kindPauseHandlers(mux, pool)
	case "fair-bench":
		cfg.Concurrency = benchConcurrent
		benchHandlers(mux, pool)
	case "tenant":
		cfg.Guard.Lease = 2 * time.Second
		tenantHandlers(mux, pool)
	case "one-shot":
		cfg.Guard.Lease = 2 * time.Second
		oneShotHandlers(mux, pool)
	}
	return cfg, mux
}

type env struct {
	redis  *testenv.RedisServer
	pool   *pgxpool.Pool
	schema string
	client *tasks.Client
	store  *jobstore.Store
}

// setup gives the test a Redis and a ledger schema of its own and runs it
// in parallel with the package's other tests.
func setup(t *testing.T) *env {
	t.Helper()
	t.Parallel()
	return setupAlone(t)
}

// setupAlone is setup for a test whose margins are CPU time: it runs
// before the parallel ones, not beside them.
func setupAlone(t *testing.T) *env {
	t.Helper()
	e := &env{redis: testenv.StartRedis(t)}
	e.pool, e.schema = testenv.PrivatePool(t, "hunt_guarantees")
	c, err := tasks.NewClient(tasks.ClientConfig{Redis: e.redisOpt(), Pool: e.pool})
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	e.client, e.store = c, jobstore.NewStore(c.Pool())
	_, err = e.pool.Exec(context.Background(), `CREATE TABLE started (job_id text, at timestamptz DEFAULT clock_timestamp());
		CREATE TABLE effects (job_id text, at timestamptz DEFAULT clock_timestamp())`)
	require.NoError(t, err)
	return e
}

func (e *env) redisOpt() asynq.RedisClientOpt { return asynq.RedisClientOpt{Addr: e.redis.Addr()} }

func (e *env) count(t *testing.T, sql string, args ...any) int {
	t.Helper()
	var n int
	require.NoError(t, e.pool.QueryRow(context.Background(), sql, args...).Scan(&n))
	return n
}

// startChild starts a worker process running which's handlers; it is
// killed when the test ends. The channel closes when it exits.
func (e *env) startChild(t *testing.T, which string) (*exec.Cmd, <-chan struct{}) {
	t.Helper()
	child := exec.Command(os.Args[0], "-test.run=^$")
	child.Env = append(os.Environ(), childEnv+"="+which, childRedisEnv+"="+e.redis.Addr(),
		testworker.ChildDatabaseURLEnv+"="+testenv.URL(e.schema))
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

// settle restarts the worker (child mode which) whenever it dies, as a
// supervisor does, until done says the jobs have settled; done also says
// what they look like, for the failure if they never do.
func (e *env) settle(t *testing.T, which string, exited <-chan struct{}, limit time.Duration, done func() (bool, string)) {
	t.Helper()
	deadline := time.Now().Add(limit)
	for {
		settled, state := done()
		if settled {
			return
		}
		require.True(t, time.Now().Before(deadline), "the jobs did not settle: %s", state)
		select {
		case <-exited:
			_, exited = e.startChild(t, which)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// started records that a handler began, committed before anything else.
func started(ctx context.Context, pool *pgxpool.Pool) error {
	id, _ := idempotency.JobID(ctx)
	_, err := pool.Exec(ctx, `INSERT INTO started (job_id) VALUES ($1)`, id)
	return err
}

// effect commits the run's effect in its completing InTx.
func effect(ctx context.Context) error {
	return idempotency.InTx(ctx, func(tx pgx.Tx) error {
		id, _ := idempotency.JobID(ctx)
		_, err := tx.Exec(ctx, `INSERT INTO effects (job_id) VALUES ($1)`, id)
		return err
	})
}

// killsItsWorker is a poison job's handler: it kills its worker a moment
// after it starts (an OOM kill, a fatal runtime error).
func killsItsWorker(pool *pgxpool.Pool, after time.Duration) func(context.Context, item) error {
	return func(ctx context.Context, _ item) error {
		if err := started(ctx, pool); err != nil {
			return err
		}
		time.Sleep(after)
		os.Exit(3)
		return nil
	}
}

// finishesAfter is an innocent job's handler: it runs for d, then commits
// its effect.
func finishesAfter(pool *pgxpool.Pool, d time.Duration) func(context.Context, item) error {
	return func(ctx context.Context, _ item) error {
		if err := started(ctx, pool); err != nil {
			return err
		}
		select {
		case <-time.After(d):
		case <-ctx.Done():
			return ctx.Err()
		}
		return effect(ctx)
	}
}
