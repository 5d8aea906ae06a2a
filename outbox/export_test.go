package outbox

import (
	"testing"
	"time"
)

// SetLegacyPollForTest sets how often an awake relay claims rows written
// unpublished until the test ends; call it before any relay runs.
func SetLegacyPollForTest(t *testing.T, d time.Duration) {
	old := legacyPoll
	legacyPoll = d
	t.Cleanup(func() { legacyPoll = old })
}

// SleepsForTest is how many times r went back to sleep after being awake:
// it let go of its locks and waits for a writer's notification again.
func (r *Relay) SleepsForTest() uint64 { return r.sleeps.Load() }

// AwakeForTest tells whether r is polling every AwakePoll: it holds the
// awake lock, or is waiting for the writers that counted on it to finish.
func (r *Relay) AwakeForTest() bool { return r.awake.Load() }
