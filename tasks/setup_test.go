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

// setup serialises the package's tests: they share one Redis DB and schema.
var setupMu sync.Mutex

func setup(t testing.TB) *bundle {
	t.Helper()
	setupMu.Lock()
	t.Cleanup(setupMu.Unlock)
	return newBundle(t, testenv.Redis(t, testenv.DBTasks), testenv.Pool(t, schema))
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
