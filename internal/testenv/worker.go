package testenv

import (
	"context"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/server"
)

// RunServer builds a worker from cfg and runs it until the test ends, then
// checks that it stopped cleanly.
func RunServer(t testing.TB, cfg server.Config, h asynq.Handler) *server.Server {
	t.Helper()
	srv, err := server.New(cfg, h)
	if err != nil {
		t.Fatalf("testenv: worker: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("testenv: worker stopped with %v", err)
		}
	})
	return srv
}

// WaitStatus polls the ledger until job id has status want.
func WaitStatus(t testing.TB, store *idempotency.Store, id string, want idempotency.Status, timeout time.Duration) idempotency.Job {
	t.Helper()
	var j idempotency.Job
	Eventually(t, timeout, func() bool {
		var err error
		j, err = store.Get(context.Background(), id)
		if err != nil {
			t.Fatalf("testenv: %v", err)
		}
		return j.Status == want
	}, "job %s never reached %s (last: %+v)", id, want, &j)
	return j
}
