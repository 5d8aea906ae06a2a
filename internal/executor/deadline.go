package executor

import (
	"context"
	"errors"
	"time"

	"github.com/hibiken/asynq"

	"github.com/keeljobs/keel/internal/jobstore"
	"github.com/keeljobs/keel/internal/ledger"
	"github.com/keeljobs/keel/retry"
)

// HandleError is for asynq.Config.ErrorHandler (server.New installs it).
// asynq fails a delivery whose deadline has passed before any middleware
// runs, then retries or archives it by its own count, and the ledger never
// hears of it: the job would be published again for ever. Here the ledger
// ends such a job at once, as dead (class deadline, alerted) or expired.
func (g *Guard) HandleError(ctx context.Context, t *asynq.Task, err error) {
	if !errors.Is(err, context.DeadlineExceeded) {
		return
	}
	id := taskID(ctx, t)
	if ledger.ValidateKey("task id", id) != nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	g.endAtDeadline(ctx, t, id, 0)
}

// endAtDeadline ends job id if its deadline comes within margin while no
// run holds it, with the alerts and counters of any death; it reports
// whether it did, and whether the job died (else it expired).
func (g *Guard) endAtDeadline(ctx context.Context, t *asynq.Task, id string, margin time.Duration) (ended, dead bool) {
	deaths, expired, err := g.store.EndPastDeadlineWithin(ctx, []string{id}, margin, g.summarize(t))
	if err != nil {
		g.stats.ledgerErrs.Add(1)
		g.cfg.Logger.Warn("keel: could not end a job past its deadline; the reconciler tries again", "job_id", id, "err", err)
		return false, false
	}
	for _, e := range expired {
		g.stats.expired.Add(1)
		noteFailure(ctx, ledger.StatusDiscarded, retry.ClassExpired)
		g.cfg.Logger.Info("keel: job expired at its deadline before it could run", "job_id", id, "kind", t.Type())
		if g.cfg.OnExpired != nil {
			g.onExpired(ctx, e)
		}
		return true, false
	}
	for _, e := range deaths {
		g.stats.dead.Add(1)
		noteFailure(ctx, ledger.StatusDead, retry.ClassDeadline)
		g.cfg.Logger.Warn("keel: job's deadline passed before it could run; it is a dead letter", "job_id", id, "kind", t.Type())
		g.died(ctx, e)
	}
	return len(deaths) > 0, len(deaths) > 0
}

func (g *Guard) onExpired(ctx context.Context, e jobstore.DeadEvent) {
	defer g.recoverHook("OnExpired", e.JobID)
	g.cfg.OnExpired(ctx, e)
}
