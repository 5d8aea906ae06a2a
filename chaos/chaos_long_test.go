//go:build chaos

package chaos_test

import (
	"testing"
	"time"
)

// TestChaosLong is the full soak (see the package doc for the command):
// 20,000 jobs over five minutes, a worker killed every 10 s meanwhile, a
// deploy every 30 s for seven minutes, Redis emptied twice and, with
// KEEL_CHAOS_PG_RESTART_CMD, Postgres restarted once. It must be done
// within 20 minutes.
func TestChaosLong(t *testing.T) {
	var kills []time.Duration
	for at := 15 * time.Second; at <= 5*time.Minute; at += 10 * time.Second {
		kills = append(kills, at)
	}
	// Deploys go on for two minutes past the submissions: the backlog
	// holds the last deploy and deploy-committed jobs that long.
	var deploys []time.Duration
	for at := 20 * time.Second; at <= 7*time.Minute; at += 30 * time.Second {
		deploys = append(deploys, at)
	}
	soak(t, soakConfig{
		Jobs:          20000,
		Workers:       3,
		Submitters:    16,
		SubmitOver:    5 * time.Minute,
		RedisRestarts: []time.Duration{40 * time.Second, 3*time.Minute + 5*time.Second},
		RedisDown:     3 * time.Second,
		Kills:         kills,
		Deploys:       deploys,
		Poison:        10,
		Hung:          30,
		DeployJobs:    200,
		Deadlines:     80,
		LateCalls:     30,
		Uniques:       30,
		CommittedCuts: 100,
		LongJobs:      600,
		CrashOnce:     12,
		PGRestartAt:   2 * time.Minute,
		Deadline:      20 * time.Minute,
	})
}
