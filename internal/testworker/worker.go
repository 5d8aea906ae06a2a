// Package testworker runs keel workers in tests: in the test's process
// (RunServer), or as a child process of the test binary that the test can
// kill or stop (RunChildWorker); and it waits on the ledger (WaitStatus),
// leaves tasks as a dead worker would (AsynqFetch) and moves time on for a
// killed one (LapseKilledWorker). It imports server and
// idempotency, so only external test packages (package x_test) and tests of
// packages above server can use it; internal/testenv, which every package's
// tests use, stays below keel's packages.
package testworker

import (
	"context"
	"os"
	"os/signal"
	"syscall"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/jobstore"
	"github.com/keeljobs/keel/internal/testenv"
	"github.com/keeljobs/keel/server"
)

// RunServer builds a worker from cfg and runs it until the test ends, then
// checks that it stopped cleanly.
func RunServer(t testing.TB, cfg server.Config, h asynq.Handler) *server.Server {
	t.Helper()
	srv, err := server.New(cfg, h)
	if err != nil {
		t.Fatalf("testworker: worker: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("testworker: worker stopped with %v", err)
		}
	})
	return srv
}

// WaitStatus polls the ledger until job id has status want.
func WaitStatus(t testing.TB, store *jobstore.Store, id string, want idempotency.Status, timeout time.Duration) idempotency.Job {
	t.Helper()
	var j idempotency.Job
	testenv.Eventually(t, timeout, func() bool {
		var err error
		j, err = store.Get(context.Background(), id)
		if err != nil {
			t.Fatalf("testworker: %v", err)
		}
		return j.Status == want
	}, "job %s never reached %s (last: %+v)", id, want, &j)
	return j
}

// ChildDatabaseURLEnv names the ledger a child worker connects to.
const ChildDatabaseURLEnv = "KEEL_CHILD_DATABASE_URL"

// RunChildWorker is for a test binary that re-runs itself as a worker
// process (to be killed or stopped by the parent): when env is set, it
// connects to the ledger in ChildDatabaseURLEnv, builds the worker's config
// and handler with build (Pool is filled in), runs it until SIGTERM and
// returns true; otherwise it returns false at once. Call it first in
// TestMain.
func RunChildWorker(env string, build func(pool *pgxpool.Pool) (server.Config, asynq.Handler)) bool {
	if os.Getenv(env) == "" {
		return false
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	cfg, err := pgxpool.ParseConfig(os.Getenv(ChildDatabaseURLEnv))
	if err != nil {
		panic(err)
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	scfg, h := build(pool)
	scfg.Pool = pool
	srv, err := server.New(scfg, h)
	if err != nil {
		panic(err)
	}
	if err := srv.Run(ctx); err != nil {
		panic(err)
	}
	return true
}
