package server_test

import (
	"context"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/internal/testenv"
	"github.com/keeljobs/keel/outbox"
	"github.com/keeljobs/keel/server"
	"github.com/keeljobs/keel/tasks"
)

func TestParseQueues(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want map[string]int
		err  string
	}{
		{in: "critical:6,default:3,low:1", want: map[string]int{"critical": 6, "default": 3, "low": 1}},
		{in: "a", want: map[string]int{"a": 1}},
		{in: " a : 2 , b ,", want: map[string]int{"a": 2, "b": 1}},
		{in: "a:0", err: `"a"`},
		{in: "a:-1", err: `"a"`},
		{in: "a:x", err: `"x"`},
		{in: "a:", err: `"a"`},
		{in: "a:1,a:2", err: "twice"},
		{in: ":3", err: "empty name"},
		{in: "", err: "names no queue"},
		{in: " , ", err: "names no queue"},
	} {
		t.Run(tc.in, func(t *testing.T) {
			got, err := server.ParseQueues(tc.in)
			if tc.err != "" {
				require.ErrorContains(t, err, tc.err)
				require.Nil(t, got)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.want, got)
		})
	}
}

func TestFormatQueuesIsParseQueuesInverse(t *testing.T) {
	require.Equal(t, "critical:6,default:3,low:1", server.FormatQueues(server.DefaultQueues()))
	require.Equal(t, "b:2,a:1,c:1", server.FormatQueues(map[string]int{"c": 1, "a": 1, "b": 2}))
	qs, err := server.ParseQueues(server.FormatQueues(server.DefaultQueues()))
	require.NoError(t, err)
	require.Equal(t, server.DefaultQueues(), qs)
}

// lazyPool is a pool that never connects unless used: Validate only needs
// it to be there.
func lazyPool(t *testing.T) *pgxpool.Pool {
	t.Helper()
	pool, err := pgxpool.New(context.Background(), testenv.URL("keel_test_server"))
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool
}

func TestConfigDefaultsAndValidate(t *testing.T) {
	redis := asynq.RedisClientOpt{Addr: testenv.RedisAddr(), DB: testenv.DBServer}
	pool := lazyPool(t)

	d := server.Config{Redis: redis, Pool: pool}.WithDefaults()
	require.NoError(t, d.Validate())
	require.Equal(t, server.DefaultConcurrency, d.Concurrency)
	require.Equal(t, server.DefaultShutdownTimeout, d.ShutdownTimeout)
	require.Equal(t, server.DefaultQueues(), d.Queues)
	require.NotNil(t, d.Classifier)
	require.NotNil(t, d.Logger)

	kept := server.Config{Redis: redis, Pool: pool, Concurrency: 3, ShutdownTimeout: time.Second,
		Queues: map[string]int{"emails": 2}}.WithDefaults()
	require.Equal(t, 3, kept.Concurrency)
	require.Equal(t, time.Second, kept.ShutdownTimeout)
	require.Equal(t, map[string]int{"emails": 2}, kept.Queues)

	// The embedded relay and reconciler use the worker's connections.
	require.Same(t, pool, d.Relay.Pool)
	require.Equal(t, redis, d.Relay.Redis)
	require.Same(t, pool, d.Reconciler.Pool)
	require.Equal(t, redis, d.Reconciler.Redis)
	off := server.Config{Redis: redis, Pool: pool, DisableRelay: true, DisableReconciler: true,
		Relay: outbox.RelayConfig{PollInterval: -1}, Reconciler: outbox.ReconcilerConfig{Interval: -1}}.WithDefaults()
	require.NoError(t, off.Validate(), "the settings of a relay and reconciler that do not run do not matter")
	require.NoError(t, server.Config{Redis: redis, Pool: pool, Concurrency: 1}.Validate(),
		"the embedded relay and reconciler take the worker's connections before WithDefaults too")

	for _, tc := range []struct {
		name string
		mod  func(*server.Config)
		err  string
	}{
		{"no Redis", func(c *server.Config) { c.Redis = nil }, "Redis"},
		{"no Pool", func(c *server.Config) { c.Pool = nil }, "Pool"},
		{"negative concurrency", func(c *server.Config) { c.Concurrency = -1 }, "concurrency"},
		{"negative shutdown timeout", func(c *server.Config) { c.ShutdownTimeout = -time.Second }, "shutdown timeout"},
		{"weight 0", func(c *server.Config) { c.Queues = map[string]int{"default": 0} }, "weight 0"},
		{"negative weight", func(c *server.Config) { c.Queues = map[string]int{"default": 3, "low": -1} }, `"low"`},
		{"queue name with a space", func(c *server.Config) { c.Queues = map[string]int{"a b": 1} }, `"a b"`},
		{"queue name with a colon", func(c *server.Config) { c.Queues = map[string]int{"a:1": 1} }, `"a:1"`},
		{"empty queue name", func(c *server.Config) { c.Queues = map[string]int{"": 1} }, "bad queue name"},
		{"bad retry policy", func(c *server.Config) { c.Retry.Base = -time.Second }, "Base"},
		{"negative relay poll interval", func(c *server.Config) { c.Relay.PollInterval = -time.Second }, "RelayConfig.PollInterval"},
		{"negative reconcile interval", func(c *server.Config) { c.Reconciler.Interval = -time.Second }, "ReconcilerConfig.Interval"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := server.Config{Redis: redis, Pool: pool}
			tc.mod(&c)
			c = c.WithDefaults()
			require.ErrorContains(t, c.Validate(), tc.err)

			// New reports the same mistake instead of panicking or starting.
			var srv *server.Server
			var err error
			c = server.Config{Redis: redis, Pool: pool}
			tc.mod(&c)
			require.NotPanics(t, func() { srv, err = server.New(c, tasks.NewMux()) })
			require.ErrorContains(t, err, tc.err)
			require.Nil(t, srv)
		})
	}

	var err error
	require.NotPanics(t, func() { _, err = server.New(server.Config{Redis: redis, Pool: pool}, nil) })
	require.ErrorContains(t, err, "handler")
	require.NotPanics(t, func() { _, err = server.New(server.Config{}, tasks.NewMux()) })
	require.ErrorContains(t, err, "Redis")
	require.NotPanics(t, func() { _, err = server.New(server.Config{Redis: oddRedisOpt{}, Pool: pool}, tasks.NewMux()) })
	require.ErrorContains(t, err, "oddRedisOpt")
}

// oddRedisOpt is a RedisConnOpt that asynq cannot use.
type oddRedisOpt struct{}

func (oddRedisOpt) MakeRedisClient() any { return "not a client" }
