package tasks_test

import (
	"context"
	"sync"
	"testing"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/internal/jobstore"
	"github.com/keeljobs/keel/internal/testenv"
	"github.com/keeljobs/keel/tasks"
)

const schema = "keel_test_tasks"

type bundle struct {
	pool   *pgxpool.Pool
	redis  asynq.RedisClientOpt
	client *tasks.Client
	store  *jobstore.Store
	insp   *asynq.Inspector
}

// setupMu serialises the examples, which share the package's Redis DB and
// schema as a program shares its own.
var setupMu sync.Mutex

// setup gives the test a Redis and a ledger schema of its own, and runs it
// in parallel with the package's other tests.
func setup(t *testing.T) *bundle {
	t.Helper()
	t.Parallel()
	pool, _ := testenv.PrivatePool(t)
	return newBundle(t, asynq.RedisClientOpt{Addr: testenv.StartRedis(t).Addr()}, pool)
}

func newBundle(t testing.TB, redis asynq.RedisClientOpt, pool *pgxpool.Pool) *bundle {
	t.Helper()
	b := &bundle{redis: redis, pool: pool}
	c, err := tasks.NewClient(tasks.ClientConfig{Redis: b.redis, Pool: b.pool})
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	b.client = c
	b.store = jobstore.NewStore(c.Pool())
	b.insp = asynq.NewInspector(b.redis)
	t.Cleanup(func() { b.insp.Close() })
	return b
}

func (b *bundle) count(t testing.TB, sql string, args ...any) int {
	t.Helper()
	var n int
	require.NoError(t, b.pool.QueryRow(context.Background(), sql, args...).Scan(&n))
	return n
}
