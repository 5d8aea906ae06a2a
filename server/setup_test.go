package server_test

import (
	"context"
	"io"
	"log/slog"
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
	insp   *asynq.Inspector
}

// setup gives the test a ledger schema and a Redis of its own, and runs it
// in parallel with the package's other tests.
func setup(t *testing.T) *bundle {
	t.Helper()
	t.Parallel()
	b := &bundle{redis: asynq.RedisClientOpt{Addr: testenv.StartRedis(t).Addr()}}
	b.pool, b.schema = testenv.PrivatePool(t)
	c, err := tasks.NewClient(tasks.ClientConfig{Redis: b.redis, Pool: b.pool, Logger: testLogger()})
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	b.client = c
	b.store = jobstore.NewStore(c.Pool())
	b.insp = asynq.NewInspector(b.redis)
	t.Cleanup(func() { b.insp.Close() })
	// What handlers under test did, and which process did it.
	_, err = b.pool.Exec(context.Background(), `CREATE TABLE marks (
		job_id text NOT NULL, what text NOT NULL, holder text NOT NULL,
		at timestamptz NOT NULL DEFAULT clock_timestamp())`)
	require.NoError(t, err)
	return b
}

// quietLogger drops everything, for tests that provoke errors on purpose.
func quietLogger() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

// testLogger keeps test output to warnings and errors.
func testLogger() *slog.Logger {
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
}

// startWorker runs a keel worker on h until the test ends.
func (b *bundle) startWorker(t *testing.T, h asynq.Handler, mod func(*server.Config)) *server.Server {
	t.Helper()
	cfg := server.Config{
		Redis:           b.redis,
		Pool:            b.pool,
		Concurrency:     10,
		ShutdownTimeout: 2 * time.Second,
		Logger:          testLogger(),
	}
	cfg.Retry.Base = time.Second
	cfg.Retry.Cap = 2 * time.Second
	cfg.Relay.PollInterval = 200 * time.Millisecond
	cfg.Guard.LedgerRetry = time.Second
	if mod != nil {
		mod(&cfg)
	}
	return testworker.RunServer(t, cfg, h)
}

func mark(ctx context.Context, pool *pgxpool.Pool, jobID, what, holder string) error {
	_, err := pool.Exec(ctx, `INSERT INTO marks (job_id, what, holder) VALUES ($1, $2, $3)`, jobID, what, holder)
	return err
}

func (b *bundle) marks(t *testing.T, jobID, what, holder string) int {
	t.Helper()
	var n int
	require.NoError(t, b.pool.QueryRow(context.Background(),
		`SELECT count(*) FROM marks WHERE job_id = $1 AND what = $2 AND ($3 = '' OR holder = $3)`,
		jobID, what, holder).Scan(&n))
	return n
}

func (b *bundle) waitStatus(t *testing.T, id string, want idempotency.Status, timeout time.Duration) idempotency.Job {
	t.Helper()
	var j idempotency.Job
	testenv.Eventually(t, timeout, func() bool {
		var err error
		j, err = b.store.Get(context.Background(), id)
		require.NoError(t, err)
		return j.Status == want
	}, "job %s never reached %s (last: %+v)", id, want, &j)
	return j
}
