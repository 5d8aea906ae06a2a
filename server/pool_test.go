package server_test

import (
	"context"
	"log/slog"
	"strings"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/internal/testworker"
	"github.com/keeljobs/keel/server"
	"github.com/keeljobs/keel/tasks"
)

// startLog keeps the messages logged through it; started closes at the
// worker's "started" line, which Run logs after its checks.
type startLog struct {
	mu      sync.Mutex
	msgs    []string
	started chan struct{}
}

func (r *startLog) Enabled(context.Context, slog.Level) bool { return true }
func (r *startLog) WithAttrs([]slog.Attr) slog.Handler       { return r }
func (r *startLog) WithGroup(string) slog.Handler            { return r }
func (r *startLog) Handle(_ context.Context, rec slog.Record) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.msgs = append(r.msgs, rec.Message)
	if rec.Message == "keel worker started" {
		close(r.started)
	}
	return nil
}

// A worker whose pool cannot give each running handler a connection says
// so at start, with the size it needs; one whose pool can says nothing.
func TestAPoolTooSmallForTheConcurrencyIsWarnedAtStart(t *testing.T) {
	b := setup(t)
	for _, tc := range []struct {
		conns int32
		warn  bool
	}{{2, true}, {int32(server.PoolSize(3)), false}} {
		cfg := b.pool.Config().Copy()
		cfg.MaxConns = tc.conns
		pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
		require.NoError(t, err)
		t.Cleanup(pool.Close)
		rec := &startLog{started: make(chan struct{})}
		testworker.RunServer(t, server.Config{Redis: b.redis, Pool: pool, Concurrency: 3, Logger: slog.New(rec)}, tasks.NewMux())
		<-rec.started
		rec.mu.Lock()
		warned := false
		for _, m := range rec.msgs {
			warned = warned || strings.Contains(m, "pool is smaller than this worker's concurrency needs")
		}
		rec.mu.Unlock()
		require.Equal(t, tc.warn, warned, "pool of %d for concurrency 3: %q", tc.conns, rec.msgs)
	}
}
