package server_test

import (
	"os"
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	// Shutdown tests run a worker in a child process: this test binary, re-run.
	if os.Getenv(childEnv) == "1" {
		os.Exit(runChildWorker())
	}
	goleak.VerifyTestMain(m,
		// go-redis and pgx pools close their background goroutines lazily.
		goleak.IgnoreTopFunction("github.com/jackc/pgx/v5/pgxpool.(*Pool).backgroundHealthCheck"),
		goleak.IgnoreTopFunction("internal/poll.runtime_pollWait"),
	)
}
