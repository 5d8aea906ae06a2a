package executor_test

import (
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	if runWorkerChild() || runGuaranteeChild() || runBatchChild() {
		return
	}
	goleak.VerifyTestMain(m,
		// go-redis and pgx pools close their background goroutines lazily.
		goleak.IgnoreTopFunction("github.com/jackc/pgx/v5/pgxpool.(*Pool).backgroundHealthCheck"),
		goleak.IgnoreTopFunction("internal/poll.runtime_pollWait"),
	)
}
