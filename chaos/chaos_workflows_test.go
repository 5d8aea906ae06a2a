//go:build chaos

package chaos_test

import "testing"

// TestChaosWorkflows is the short soak with 60 workflows of five
// dependent jobs (a fan-out, a fan-in and a tail) among its jobs: through
// its kills, deploys, Redis restart and Postgres restart every workflow
// job succeeds once, none runs before its parents succeeded, none is left
// waiting, and none is lost.
//
//	go test -tags chaos -run TestChaosWorkflows -timeout 10m -v ./chaos
func TestChaosWorkflows(t *testing.T) {
	cfg := shortSoak()
	cfg.Workflows = 60
	soak(t, cfg)
}
