//go:build chaos

package chaos_test

import "testing"

// TestChaosBatches is the short soak with every job in one of 24 batches
// (each of one class, so some all succeed and some have dead members):
// through its kills, deploys and Redis restart, each batch completes once,
// its counters match its members' statuses, on_complete runs once with
// those counts and on_success once exactly when every member succeeded.
//
//	go test -tags chaos -run TestChaosBatches -timeout 10m -v ./chaos
func TestChaosBatches(t *testing.T) {
	cfg := shortSoak()
	cfg.Batches = 3 * len(classes)
	soak(t, cfg)
}
