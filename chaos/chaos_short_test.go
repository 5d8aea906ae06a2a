package chaos_test

import (
	"testing"
	"time"
)

// TestChaosShort is the soak CI runs: 2,000 jobs, one worker killed with
// SIGKILL early on, two deploys (SIGTERM) in the middle of long MaxRetry(0)
// jobs, two poison jobs that kill four workers, six hung handlers, and
// Redis emptied once.
func TestChaosShort(t *testing.T) {
	if testing.Short() {
		t.Skip("chaos soak: 30 to 90 s")
	}
	soak(t, shortSoak())
}

// shortSoak is the short soak's run, which its variants (batches,
// workflows) extend.
func shortSoak() soakConfig {
	return soakConfig{
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
	}
}
