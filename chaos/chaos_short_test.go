package chaos_test

import (
	"testing"
	"time"
)

// TestChaosShort is the soak CI runs: 2,000 jobs, one worker killed with
// SIGKILL early on and Redis emptied once. The kill comes after the Redis
// restart so that the killed worker's tasks are recovered by asynq itself
// (30 s lease, recoverer every minute), which sets the run's length.
func TestChaosShort(t *testing.T) {
	if testing.Short() {
		t.Skip("chaos soak: about 90 s")
	}
	soak(t, soakConfig{
		Jobs:          2000,
		Workers:       3,
		Submitters:    8,
		SubmitOver:    20 * time.Second,
		RedisRestarts: []time.Duration{6 * time.Second},
		RedisDown:     2 * time.Second,
		Kills:         []time.Duration{11 * time.Second},
		Deploys:       []time.Duration{13 * time.Second, 16500 * time.Millisecond},
		Poison:        2,
		Hung:          6,
		DeployJobs:    30,
		PGRestartAt:   15 * time.Second,
		Deadline:      230 * time.Second,
	})
}
