//go:build chaos

package chaos_test

import (
	"testing"
	"time"
)

// TestChaosWorkflows is the short soak with 60 workflows of five
// dependent jobs (a fan-out, a fan-in and a tail) among its jobs: through
// its kills, deploys, Redis restart and Postgres restart every workflow
// job succeeds once, none runs before its parents succeeded, none is left
// waiting, and none is lost.
//
//	go test -tags chaos -run TestChaosWorkflows -timeout 10m -v ./chaos
func TestChaosWorkflows(t *testing.T) {
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
		Workflows:     60,
	})
}
