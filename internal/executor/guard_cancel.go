package executor

import (
	"context"
	"time"

	"github.com/keeljobs/keel/internal/ledger"
	"github.com/keeljobs/keel/internal/outcome"
)

// cancelCheckTimeout bounds the look-up of whether a job was cancelled; it
// runs on a context of its own, since the run's may be the one cancelled.
const cancelCheckTimeout = 5 * time.Second

// leaseFate is what the ledger says of a run whose lease renewal found it
// no longer running under this worker.
type leaseFate int

const (
	fateLost      leaseFate = iota // another worker holds it, or it was handed back
	fateCancelled                  // cancelled: its canceller recorded it
	fateDone                       // this very run's InTx committed it succeeded
)

// leaseFates reads the fates of runs a renewal did not keep. An InTx that
// commits just before the renewal reads the row leaves it succeeded by this
// run before the run notes it has completed: that run lost nothing. It
// must have sent its COMMIT, and the job's last run must be this one.
func (g *Guard) leaseFates(ctx context.Context, jcs []*jobContext) (map[*jobContext]leaseFate, error) {
	ids := make([]string, len(jcs))
	for i, jc := range jcs {
		ids[i] = jc.id
	}
	ctx, cancel := context.WithTimeout(ctx, cancelCheckTimeout)
	defer cancel()
	found, err := ledger.RunFates(ctx, g.store.Pool(), ids)
	if err != nil {
		return nil, err
	}
	byID := make(map[string]ledger.RunFate, len(found))
	for _, r := range found {
		byID[r.ID] = r
	}
	out := make(map[*jobContext]leaseFate, len(jcs))
	for _, jc := range jcs {
		r, ok := byID[jc.id]
		switch {
		case ok && r.Status == ledger.StatusCancelled:
			out[jc] = fateCancelled
		case ok && r.Status == ledger.StatusSucceeded && r.Run == jc.run && r.LastHolder == g.cfg.Holder && jc.committing.Load():
			out[jc] = fateDone
		default:
			out[jc] = fateLost
		}
	}
	return out, nil
}

// isCancelled reports whether the ledger says job id is cancelled; an
// unreadable ledger says no.
func (g *Guard) isCancelled(ctx context.Context, id string) bool {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), cancelCheckTimeout)
	defer cancel()
	cancelled, err := ledger.Cancelled(ctx, g.store.Pool(), id)
	return err == nil && cancelled
}

// stopCancelled stops a live run whose job was cancelled: its context is
// cancelled with ErrCancelled and its InTx and Step are refused from now on.
// The ledger already says cancelled (the canceller wrote it), so nothing is
// recorded here.
func (g *Guard) stopCancelled(jc *jobContext) {
	if !jc.state.CompareAndSwap(runLive, runCancelled) {
		return
	}
	g.untrack(jc)
	jc.cancel(ErrCancelled)
	g.countCancelled(jc)
	// As for a run given up at its timeout: a handler hung inside InTx
	// would hold its connection, and its locks, for as long as it hangs.
	jc.dropTx()
	g.markStray(jc)
}

// cancelledLate handles a run that returned and found its job no longer
// running because it was cancelled meanwhile (the handler did not wait to
// be stopped, or asynq's cancel ended it first).
func (g *Guard) cancelledLate(ctx context.Context, jc *jobContext) bool {
	if !g.isCancelled(ctx, jc.id) {
		return false
	}
	jc.state.Store(runCancelled)
	g.countCancelled(jc)
	outcome.Note(ctx, outcome.Cancelled)
	// The canceller marked the run as one that may still act; it has
	// returned, so a newer job of the key need not wait for the mark to
	// run out.
	if !g.strays.has(jc.id) {
		g.clearStray(jc.id)
	}
	return true
}

func (g *Guard) countCancelled(jc *jobContext) {
	g.stats.cancelled.Add(1)
	g.cfg.Logger.Info("keel: job cancelled while it ran; its run is stopped and nothing it does now can commit",
		"job_id", jc.id, "kind", jc.kind, "attempt", jc.attempt)
	if g.cfg.OnCancelled != nil {
		g.onCancelled(CancelEvent{JobID: jc.id, Kind: jc.kind, Queue: jc.queue, Attempt: jc.attempt})
	}
}
