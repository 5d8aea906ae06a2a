package executor

import (
	"context"
	"sync/atomic"
	"time"
)

// ClaimedRun is a job a test claimed through a guard's round.
type ClaimedRun struct {
	ID      string
	Attempt int
	Alone   bool // it must run alone on its worker
	run     int
	inBatch bool
}

// ClaimForTest claims job id through the guard's round, as a delivery does.
func (g *Guard) ClaimForTest(ctx context.Context, id string) (ClaimedRun, error) {
	res := g.claim(ctx, id)
	if res.err == nil && res.outcome != claimed {
		return ClaimedRun{}, ErrLeaseHeld
	}
	return ClaimedRun{ID: id, Attempt: res.attempts, Alone: res.alone, run: res.run, inBatch: res.batchID != ""}, res.err
}

// CompleteRoundForTest runs one round that marks runs succeeded, in the
// order given, as the batcher does when their marks wait together, and
// returns each mark's result.
func (g *Guard) CompleteRoundForTest(ctx context.Context, runs ...ClaimedRun) []error {
	reqs := make([]ledgerReq, len(runs))
	for i, r := range runs {
		reqs[i] = ledgerReq{id: r.ID, run: r.run, inBatch: r.inBatch, complete: true, doneOut: make(chan error, 1)}
	}
	g.runRound(ctx, reqs)
	errs := make([]error, len(reqs))
	for i, r := range reqs {
		errs[i] = <-r.doneOut
	}
	return errs
}

// RenewForTest renews the leases of runs, in the order given, as the renew
// loop does, and returns the ids it renewed.
func (g *Guard) RenewForTest(ctx context.Context, runs ...ClaimedRun) ([]string, error) {
	ids := make([]string, len(runs))
	nums := make([]int32, len(runs))
	for i, r := range runs {
		ids[i], nums[i] = r.ID, int32(r.run)
	}
	return g.renew(ctx, ids, nums)
}

// SetInTxCommittedHook sets what this guard's InTx calls after its commit
// lands and before the run notes it; nil removes it.
func (g *Guard) SetInTxCommittedHook(hook func(jobID string)) {
	if hook == nil {
		g.inTxCommittedHook.Store(nil)
		return
	}
	g.inTxCommittedHook.Store(&hook)
}

// TestSignals are a guard's test signals; Renewal is what Renewed carries.
type (
	TestSignals = testSignals
	Renewal     = renewal
)

// InitTestSignals turns on the test signals of the guard made with cfg
// (by NewGuard or server.New); call it before.
func InitTestSignals(cfg *GuardConfig) *TestSignals {
	cfg.signals.Renewed.Init()
	cfg.signals.Overran.Init()
	cfg.signals.Busy.Init()
	cfg.signals.Skipped.Init()
	cfg.signals.LateClaim.Init()
	return &cfg.signals
}

// GuardMadeWith returns the guard that will be made with cfg (a worker's,
// say), nil until it is.
func GuardMadeWith(cfg *GuardConfig) func() *Guard {
	var g atomic.Pointer[Guard]
	cfg.signals.made = func(made *Guard) { g.Store(made) }
	return g.Load
}

// ShareTestSignals turns on the test signals of the guard made with cfg,
// sending them to shared's channels (another guard's): a test waits on two
// workers' guards as one.
func ShareTestSignals(cfg *GuardConfig, shared *TestSignals) {
	cfg.signals.Renewed.Share(&shared.Renewed)
	cfg.signals.Overran.Share(&shared.Overran)
	cfg.signals.Busy.Share(&shared.Busy)
	cfg.signals.Skipped.Share(&shared.Skipped)
	cfg.signals.LateClaim.Share(&shared.LateClaim)
}

// ReleaseForTest hands run back uncounted, as a deploy's interrupted run
// is handed back.
func (g *Guard) ReleaseForTest(ctx context.Context, r ClaimedRun) {
	g.release(ctx, &jobContext{id: r.ID, attempt: r.Attempt, run: r.run})
}

// ClaimExhaustedForTest reports whether a claim of job id finds it to be
// retired as a poison job rather than run.
func (g *Guard) ClaimExhaustedForTest(ctx context.Context, id string) (bool, error) {
	res := g.claim(ctx, id)
	return res.outcome == claimExhausted, res.err
}

// EnterGateForTest is a delivery passing the worker's gate (and leaving
// at once): nil when a delivery could start its handler now.
func (g *Guard) EnterGateForTest(ctx context.Context, wait time.Duration) error {
	p, err := g.gate.enter(ctx, wait)
	if err == nil {
		p.leave()
	}
	return err
}
