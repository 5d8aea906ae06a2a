package idempotency

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
)

// cancelCheckTimeout bounds the look-up of whether a job was cancelled; it
// runs on a context of its own, since the run's may be the one cancelled.
const cancelCheckTimeout = 5 * time.Second

// cancelledAmong returns which of jcs' jobs the ledger says are cancelled.
func (g *Guard) cancelledAmong(ctx context.Context, jcs []*jobContext) map[string]bool {
	if len(jcs) == 0 {
		return nil
	}
	ids := make([]string, len(jcs))
	for i, jc := range jcs {
		ids[i] = jc.id
	}
	ctx, cancel := context.WithTimeout(ctx, cancelCheckTimeout)
	defer cancel()
	rows, err := g.store.pool.Query(ctx, `SELECT id FROM keel_jobs WHERE id = ANY($1) AND status = 'cancelled'`, ids)
	if err != nil {
		return nil
	}
	found, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil
	}
	out := make(map[string]bool, len(found))
	for _, id := range found {
		out[id] = true
	}
	return out
}

// isCancelled reports whether the ledger says job id is cancelled; an
// unreadable ledger says no.
func (g *Guard) isCancelled(ctx context.Context, id string) bool {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), cancelCheckTimeout)
	defer cancel()
	var cancelled bool
	err := g.store.pool.QueryRow(ctx, `SELECT status = 'cancelled' FROM keel_jobs WHERE id = $1`, id).Scan(&cancelled)
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
	return true
}

func (g *Guard) countCancelled(jc *jobContext) {
	g.stats.cancelled.Add(1)
	g.cfg.Logger.Info("keel: job cancelled while it ran; its run is stopped and nothing it does now can commit",
		"job_id", jc.id, "kind", jc.kind, "attempt", jc.attempt)
	if g.cfg.OnCancelled != nil {
		g.cfg.OnCancelled(context.Background(), CancelEvent{JobID: jc.id, Kind: jc.kind, Queue: jc.queue, Attempt: jc.attempt})
	}
}
