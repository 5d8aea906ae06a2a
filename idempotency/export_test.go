package idempotency

import "context"

// ClaimedRun is a job a test claimed through a guard's round.
type ClaimedRun struct {
	ID      string
	Attempt int
	inBatch bool
}

// ClaimForTest claims job id through the guard's round, as a delivery does.
func (g *Guard) ClaimForTest(ctx context.Context, id string) (ClaimedRun, error) {
	res := g.claim(ctx, id)
	if res.err == nil && res.outcome != claimed {
		return ClaimedRun{}, ErrLeaseHeld
	}
	return ClaimedRun{ID: id, Attempt: res.attempts, inBatch: res.batchID != ""}, res.err
}

// CompleteRoundForTest runs one round that marks runs succeeded, in the
// order given, as the batcher does when their marks wait together, and
// returns each mark's result.
func (g *Guard) CompleteRoundForTest(ctx context.Context, runs ...ClaimedRun) []error {
	reqs := make([]ledgerReq, len(runs))
	for i, r := range runs {
		reqs[i] = ledgerReq{id: r.ID, attempt: r.Attempt, inBatch: r.inBatch, complete: true, doneOut: make(chan error, 1)}
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
	attempts := make([]int32, len(runs))
	for i, r := range runs {
		ids[i], attempts[i] = r.ID, int32(r.Attempt)
	}
	return g.renew(ctx, ids, attempts)
}

// SetTestHooks sets what InTx calls after its commit lands and before the
// run notes it, and what the renew loop calls after each renewal; nil
// removes a hook.
func SetTestHooks(inTxCommitted func(jobID string), renewed func()) {
	inTxCommittedHook.Store(nil)
	renewedHook.Store(nil)
	if inTxCommitted != nil {
		inTxCommittedHook.Store(&inTxCommitted)
	}
	if renewed != nil {
		renewedHook.Store(&renewed)
	}
}
