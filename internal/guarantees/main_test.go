// Package guarantees_test attacks keel's promises across its packages with
// real worker processes, a private Redis and its own ledger schema.
package guarantees_test

import (
	"context"
	"fmt"
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
		cfg.Guard.TimeoutGrace = 3 * time.Second
		// A worker killed between a postponed job's delivery and its claim
		// leaves the job to the reconciler, after its grace, whose length
		// is not the point.
		cfg.Reconciler.Interval, cfg.Reconciler.Grace = 200*time.Millisecond, 200*time.Millisecond
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
		// Redis loses everything before these workers start: the
		// reconciler publishes the jobs in flight again once they were
		// left alone for its grace, whose length is not the point.
		cfg.Reconciler.Interval, cfg.Reconciler.Grace = 200*time.Millisecond, 200*time.Millisecond
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
// before the parallel ones, not beside them. A test that calls t.Parallel
// itself later uses it to start something before them.
func setupAlone(t *testing.T) *env {
	t.Helper()
	e := &env{redis: testenv.StartRedis(t)}
	e.pool, e.schema = testenv.PrivatePool(t)
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

// child is a worker process of the test's.
type child struct {
	cmd    *exec.Cmd
	exited <-chan struct{} // closed once it has exited
}

// startChild starts a worker process running which's handlers; it is
// killed when the test ends.
func (e *env) startChild(t *testing.T, which string) *child {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), childEnv+"="+which, childRedisEnv+"="+e.redis.Addr(),
		testworker.ChildDatabaseURLEnv+"="+testenv.URL(e.schema))
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	require.NoError(t, cmd.Start())
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-exited
	})
	return &child{cmd: cmd, exited: exited}
}

// replace starts a worker in the place of c, which died, as a supervisor
// does. The seconds until c's leases run out are moved on
// (testworker.LapseKilledWorker): what follows a death is the same, the
// new worker's rescuer takes the dead one's jobs back at its first look.
func (e *env) replace(t *testing.T, which string, c *child) *child {
	t.Helper()
	<-c.exited
	testworker.LapseKilledWorker(t, e.pool, e.redisOpt(), c.cmd.Process.Pid)
	return e.startChild(t, which)
}

// settle replaces the workers (child mode which) whenever one dies, until
// done says the jobs have settled; done also says what they look like, for
// the failure if they never do.
func (e *env) settle(t *testing.T, which string, limit time.Duration, done func() (bool, string), workers ...*child) {
	t.Helper()
	e.settleWhen(t, which, nil, limit, done, workers...)
}

// settleWhen is settle for a test that needs something on a new worker
// before the dead one's jobs come back to it: a dead worker's leases are
// moved on once ready holds for its replacement (or that died too), not at
// once.
func (e *env) settleWhen(t *testing.T, which string, ready func(*child) bool, limit time.Duration, done func() (bool, string), workers ...*child) {
	t.Helper()
	type lapse struct {
		pid   int
		after *child // the dead worker's replacement
	}
	var owed []lapse
	deadline := time.Now().Add(limit)
	for {
		settled, state := done()
		if settled {
			return
		}
		require.True(t, time.Now().Before(deadline), "the jobs did not settle: %s", state)
		for i, c := range workers {
			select {
			case <-c.exited:
				workers[i] = e.startChild(t, which)
				owed = append(owed, lapse{c.cmd.Process.Pid, workers[i]})
			default:
			}
		}
		kept := owed[:0]
		for _, l := range owed {
			select {
			case <-l.after.exited:
			default:
				if ready != nil && !ready(l.after) {
					kept = append(kept, l)
					continue
				}
			}
			testworker.LapseKilledWorker(t, e.pool, e.redisOpt(), l.pid)
		}
		owed = kept
		time.Sleep(20 * time.Millisecond)
	}
}

// holds is the LIKE pattern of the ledger's holders (host/pid/random) of
// worker c.
func (c *child) holds() string { return fmt.Sprintf("%%/%d/%%", c.cmd.Process.Pid) }

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
