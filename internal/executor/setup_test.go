package executor_test

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/jobstore"
	"github.com/keeljobs/keel/internal/testenv"
	"github.com/keeljobs/keel/internal/testworker"
	"github.com/keeljobs/keel/server"
	"github.com/keeljobs/keel/tasks"
)

type bundle struct {
	pool   *pgxpool.Pool
	schema string
	redis  asynq.RedisClientOpt
	client *tasks.Client
	store  *jobstore.Store
}

// setup gives the test a ledger schema and a Redis of its own, and runs it
// in parallel with the package's other tests.
func setup(t *testing.T) *bundle {
	t.Helper()
	t.Parallel()
	return setupAlone(t)
}

// setupAlone is setup for a test that changes process state (the global
// tracer provider): it runs before the parallel tests, not beside them.
func setupAlone(t *testing.T) *bundle {
	t.Helper()
	b := &bundle{redis: asynq.RedisClientOpt{Addr: testenv.StartRedis(t).Addr()}}
	b.pool, b.schema = testenv.PrivatePool(t)
	c, err := tasks.NewClient(tasks.ClientConfig{Redis: b.redis, Pool: b.pool})
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	b.client = c
	b.store = jobstore.NewStore(c.Pool())
	// Effects tables for handlers under test.
	_, err = b.pool.Exec(context.Background(), `CREATE TABLE effects (job_id text, name text, at timestamptz DEFAULT now())`)
	require.NoError(t, err)
	return b
}

// childEnv is what a worker process the test starts needs to reach the
// test's ledger schema and Redis (see redisOpt).
func (b *bundle) childEnv(which string) []string {
	return append(os.Environ(), which+"=1", childRedisEnv+"="+b.redis.Addr,
		testworker.ChildDatabaseURLEnv+"="+testenv.URL(b.schema)+"&application_name="+b.schema)
}

// childRedisEnv names the Redis address of a child worker.
const childRedisEnv = "KEEL_EXECUTOR_CHILD_REDIS"

func redisOpt() asynq.RedisClientOpt { return asynq.RedisClientOpt{Addr: os.Getenv(childRedisEnv)} }

// startWorker runs a keel worker on mux until the test ends.
func (b *bundle) startWorker(t *testing.T, mux *tasks.Mux, mod func(*server.Config)) *server.Server {
	t.Helper()
	cfg := server.Config{
		Redis:           b.redis,
		Pool:            b.pool,
		Concurrency:     10,
		ShutdownTimeout: 2 * time.Second,
	}
	cfg.Retry.Base = time.Second
	cfg.Retry.Cap = 2 * time.Second
	cfg.Relay.PollInterval = 200 * time.Millisecond
	cfg.Guard.LedgerRetry = time.Second
	if mod != nil {
		mod(&cfg)
	}
	return testworker.RunServer(t, cfg, mux)
}

func (b *bundle) count(t *testing.T, sql string, args ...any) int {
	t.Helper()
	var n int
	require.NoError(t, b.pool.QueryRow(context.Background(), sql, args...).Scan(&n))
	return n
}

func (b *bundle) waitStatus(t *testing.T, id string, want idempotency.Status, timeout time.Duration) idempotency.Job {
	t.Helper()
	return testworker.WaitStatus(t, b.store, id, want, timeout)
}
