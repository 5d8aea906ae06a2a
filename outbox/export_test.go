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
