package outbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/internal/testenv"
	"github.com/keeljobs/keel/outbox"
)

// lazyPool is a pool that never connects unless used: New and Validate only
// need it to be there.
func lazyPool(t *testing.T) *pgxpool.Pool {
	t.Helper()
	pool, err := pgxpool.New(context.Background(), testenv.URL("keel_test_outbox"))
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool
}

func TestNewRelayRefusesAConfigThatCannotWork(t *testing.T) {
	t.Parallel()
	pool, opt := lazyPool(t), asynq.RedisClientOpt{Addr: testenv.RedisAddr(), DB: testenv.DBOutbox}
	for _, tc := range []struct {
		name string
		mod  func(*outbox.RelayConfig)
		err  []string
	}{
		{"no Pool", func(c *outbox.RelayConfig) { c.Pool = nil }, []string{"RelayConfig.Pool is required"}},
		{"no Redis", func(c *outbox.RelayConfig) { c.Redis = nil }, []string{"RelayConfig.Redis is required"}},
		{"negative PollInterval", func(c *outbox.RelayConfig) { c.PollInterval = -time.Second }, []string{"PollInterval", "-1s"}},
		{"negative AwakePoll", func(c *outbox.RelayConfig) { c.AwakePoll = -time.Millisecond }, []string{"AwakePoll"}},
		{"negative IdleAfter", func(c *outbox.RelayConfig) { c.IdleAfter = -time.Millisecond }, []string{"IdleAfter"}},
		{"negative BatchSize", func(c *outbox.RelayConfig) { c.BatchSize = -1 }, []string{"BatchSize"}},
		{"all of it at once", func(c *outbox.RelayConfig) { *c = outbox.RelayConfig{BatchSize: -1} },
			[]string{"Pool", "Redis", "BatchSize"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := outbox.RelayConfig{Pool: pool, Redis: opt}
			tc.mod(&c)
			for _, want := range tc.err {
				require.ErrorContains(t, c.Validate(), want)
			}
			var r *outbox.Relay
			var err error
			require.NotPanics(t, func() { r, err = outbox.NewRelay(c) })
			for _, want := range tc.err {
				require.ErrorContains(t, err, want)
			}
			require.Nil(t, r)
		})
	}

	require.NoError(t, outbox.RelayConfig{Pool: pool, Redis: opt}.Validate())
	r, err := outbox.NewRelay(outbox.RelayConfig{Pool: pool, Redis: opt})
	require.NoError(t, err)
	require.NoError(t, r.Close())
}

func TestNewReconcilerRefusesAConfigThatCannotWork(t *testing.T) {
	t.Parallel()
	pool, opt := lazyPool(t), asynq.RedisClientOpt{Addr: testenv.RedisAddr(), DB: testenv.DBOutbox}
	for _, tc := range []struct {
		name string
		mod  func(*outbox.ReconcilerConfig)
		err  []string
	}{
		{"no Pool", func(c *outbox.ReconcilerConfig) { c.Pool = nil }, []string{"ReconcilerConfig.Pool is required"}},
		{"no Redis", func(c *outbox.ReconcilerConfig) { c.Redis = nil }, []string{"ReconcilerConfig.Redis is required"}},
		{"Redis asynq cannot use", func(c *outbox.ReconcilerConfig) { c.Redis = oddRedisOpt{} }, []string{"oddRedisOpt"}},
		{"negative Interval", func(c *outbox.ReconcilerConfig) { c.Interval = -time.Second }, []string{"Interval", "-1s"}},
		{"negative Grace", func(c *outbox.ReconcilerConfig) { c.Grace = -time.Second }, []string{"Grace"}},
		{"negative BatchSize", func(c *outbox.ReconcilerConfig) { c.BatchSize = -1 }, []string{"BatchSize"}},
		{"negative PruneBatch", func(c *outbox.ReconcilerConfig) { c.PruneBatch = -1 }, []string{"PruneBatch"}},
		{"negative PruneInterval", func(c *outbox.ReconcilerConfig) { c.PruneInterval = -time.Minute }, []string{"PruneInterval"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := outbox.ReconcilerConfig{Pool: pool, Redis: opt}
			tc.mod(&c)
			var r *outbox.Reconciler
			var err error
			require.NotPanics(t, func() { r, err = outbox.NewReconciler(c) })
			for _, want := range tc.err {
				require.ErrorContains(t, err, want)
			}
			require.Nil(t, r)
		})
	}

	// Negative RescueInterval and Retention are not mistakes: they turn
	// rescuing and pruning off.
	ok := outbox.ReconcilerConfig{Pool: pool, Redis: opt, RescueInterval: -1, Retention: -1}
	require.NoError(t, ok.Validate())
	r, err := outbox.NewReconciler(ok)
	require.NoError(t, err)
	require.NoError(t, r.Close())
}

// newRelay and newReconciler build what a test knows to be a valid config.
func newRelay(t testing.TB, c outbox.RelayConfig) *outbox.Relay {
	t.Helper()
	r, err := outbox.NewRelay(c)
	require.NoError(t, err)
	return r
}

func newReconciler(t testing.TB, c outbox.ReconcilerConfig) *outbox.Reconciler {
	t.Helper()
	r, err := outbox.NewReconciler(c)
	require.NoError(t, err)
	return r
}

// oddRedisOpt is a RedisConnOpt that makes no go-redis client.
type oddRedisOpt struct{}

func (oddRedisOpt) MakeRedisClient() any { return "not a client" }
