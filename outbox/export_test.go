package outbox

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/keeljobs/keel/internal/ledger"
)

// SetLegacyPollForTest sets how often an awake relay claims rows written
// unpublished until the test ends; call it before any relay runs.
func SetLegacyPollForTest(t *testing.T, d time.Duration) {
	old := legacyPoll
	legacyPoll = d
	t.Cleanup(func() { legacyPoll = old })
}

// RelaySignals are a relay's test signals; RelayPass is what Passed
// carries.
type (
	RelaySignals = relaySignals
	RelayPass    = relayPass
	RelayState   = relayState
)

// The states a RelayPass reports.
const (
	RelayAsleep   = asleep
	RelayAwake    = awake
	RelaySettling = settling
)

func (s relayState) String() string {
	switch s {
	case asleep:
		return "asleep"
	case awake:
		return "awake"
	case settling:
		return "settling"
	}
	return "relayState(?)"
}

// InitRelaySignals turns r's test signals on; call it before Run.
func InitRelaySignals(r *Relay) *RelaySignals {
	r.signals.Listening.Init()
	r.signals.Passed.Init()
	return &r.signals
}

// ShareRelaySignals turns r's test signals on, sending them to shared's
// channels (another relay's): the test waits on both as one.
func ShareRelaySignals(r *Relay, shared *RelaySignals) {
	r.signals.Listening.Share(&shared.Listening)
	r.signals.Passed.Share(&shared.Passed)
}

// RelayClock is the clock a relay judges its idleness by, which a test
// moves ahead of the wall clock.
type RelayClock struct{ ahead atomic.Int64 }

// Add moves the clock d further ahead.
func (c *RelayClock) Add(d time.Duration) { c.ahead.Add(int64(d)) }

// MoveRelayClock gives r a clock the test moves; call it before Run.
func MoveRelayClock(r *Relay) *RelayClock {
	c := &RelayClock{}
	r.clock = func() time.Time { return time.Now().Add(time.Duration(c.ahead.Load())) }
	return c
}

// ReconcileSignals are a reconciler's test signals; ReconcilePass and
// RescuePass are what they carry.
type (
	ReconcileSignals = reconcileSignals
	ReconcilePass    = reconcilePass
	RescuePass       = rescuePass
)

// InitReconcileSignals turns r's test signals on; call it before Run.
func InitReconcileSignals(r *Reconciler) *ReconcileSignals {
	r.signals.Passed.Init()
	r.signals.Rescued.Init()
	return &r.signals
}

// PruneAt is r.Prune with the ledger's clock at now.
func PruneAt(ctx context.Context, r *Reconciler, now time.Time) (int, error) {
	return r.prune(ctx, ledger.At(now))
}

// ApplyPauses is the step of r's pass that pauses in Redis the queues the
// ledger holds paused.
func ApplyPauses(ctx context.Context, r *Reconciler) error { return r.applyPauses(ctx) }

// AfterPausesHook makes each of r's passes call fn between the step that
// pauses in Redis the queues the ledger has paused and the scan for jobs
// Redis lost; call it before the first pass.
func AfterPausesHook(r *Reconciler, fn func()) { r.afterPauses = fn }
