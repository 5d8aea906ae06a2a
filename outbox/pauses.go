package outbox

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/keeljobs/keel/internal/asynqwire"
	"github.com/keeljobs/keel/internal/ledger"
)

// endHeldPastDeadline ends the jobs a kind's pause holds whose deadline
// has passed (dead, or expired where their kind drops stale work), as it
// ends those waiting in Redis: a deadline ends a job, paused or not.
func (r *Reconciler) endHeldPastDeadline(ctx context.Context) error {
	ids, err := ledger.HeldPastDeadline(ctx, r.pool, r.cfg.BatchSize, nil)
	if err != nil || len(ids) == 0 {
		return err
	}
	deaths, expired, err := r.store.EndPastDeadline(ctx, ids)
	if err != nil {
		return err
	}
	if len(expired) > 0 {
		r.cfg.Logger.Info("keel reconciler: held jobs of a paused kind expired at their deadline", "jobs", len(expired))
	}
	return r.died(ctx, deaths)
}

// applyPauses pauses in Redis every queue the ledger holds paused (see
// inspect.PauseQueue): a Redis that lost its data, or a pause recorded
// while Redis was down, gets it back within a pass. It never resumes a
// queue: a queue paused in Redis alone was paused by a person with
// asynq's own tools. The pauses stay locked while it applies them, so a
// resume racing the pass cannot lift one in Redis before the pass puts it
// back (leaving a queue paused in Redis alone, which no pass would lift).
func (r *Reconciler) applyPauses(ctx context.Context) error {
	return pgx.BeginFunc(ctx, r.pool, func(tx pgx.Tx) error {
		ps, err := ledger.PausesToApply(ctx, tx)
		if err != nil {
			return err
		}
		for _, p := range ps {
			changed, err := asynqwire.Pause(ctx, r.rdb, p.Queue, time.Now())
			if err != nil {
				return err
			}
			if changed {
				r.cfg.Logger.Warn("keel reconciler: paused a queue again in Redis, which had lost its pause",
					"queue", p.Queue, "paused_by", p.PausedBy, "paused_at", p.PausedAt)
			}
		}
		return nil
	})
}
