//go:build chaos

package chaos_test

import (
	"testing"
	"time"
)

// TestChaosBatches is the short soak with every job in one of 24 batches
// (each of one class, so some all succeed and some have dead members):
// through its kills, deploys and Redis restart, each batch completes once,
// its counters match its members' statuses, on_complete runs once with
// those counts and on_success once exactly when every member succeeded.
//
//	go test -tags chaos -run TestChaosBatches -timeout 10m -v ./chaos
func TestChaosBatches(t *testing.T) {
	soak(t, soakConfig{
		Jobs:          2000,
		Workers:       3,
		Submitters:    8,
		SubmitOver:    20 * time.Second,
		RedisRestarts: []time.Duration{6 * time.Second},
		RedisDown:     2 * time.Second,
		Kills:         []time.Duration{11 * time.Second},
		Deploys:       []time.Duration{14 * time.Second, 17 * time.Second},
		Poison:        2,
		Hung:          6,
		DeployJobs:    30,
		Deadlines:     16,
		LateCalls:     6,
		Uniques:       6,
		CommittedCuts: 20,
		LongJobs:      60,
		CrashOnce:     3,
		PGRestartAt:   15 * time.Second,
		Deadline:      230 * time.Second,
		Batches:       3 * len(classes),
	})
}
