package chaos_test

import (
	"os"
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	// The soak's workers are this test binary, started again as children.
	if os.Getenv(envWorker) != "" {
		os.Exit(runWorkerChild())
	}
	goleak.VerifyTestMain(m,
		// go-redis and pgx pools close their background goroutines lazily.
		goleak.IgnoreTopFunction("github.com/jackc/pgx/v5/pgxpool.(*Pool).backgroundHealthCheck"),
		goleak.IgnoreTopFunction("internal/poll.runtime_pollWait"),
	)
}
