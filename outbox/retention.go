package outbox

import (
	"context"
	"maps"
	"sync"

	"github.com/keeljobs/keel/internal/ledger"
)

// KindStatus names the jobs of one kind in one status, as the pruned
// counters count them.
type KindStatus struct{ Kind, Status string }

// retained is what pruning did per kind, for the metrics.
type retained struct {
	mu       sync.Mutex
	prunedBy map[KindStatus]uint64
	toDrop   map[string]int
}

func (t *retained) add(kind, status string, n int) {
	if n == 0 {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.prunedBy == nil {
		t.prunedBy = map[KindStatus]uint64{}
	}
	t.prunedBy[KindStatus{kind, status}] += uint64(n)
}

// PrunedByKind returns how many jobs this reconciler pruned (dead letters
// dropped among them, as status dead), per kind and status.
func (r *Reconciler) PrunedByKind() map[KindStatus]uint64 {
	r.retained.mu.Lock()
	defer r.retained.mu.Unlock()
	return maps.Clone(r.retained.prunedBy)
}

// DeadLettersToDrop returns, per kind, how many seen dead letters past the
// kind's bounds this reconciler's last prune found alerted and waiting out
// their notice (DeadDropNotice) before they are dropped. Kinds with none
// are left out.
func (r *Reconciler) DeadLettersToDrop() map[string]int {
	r.retained.mu.Lock()
	defer r.retained.mu.Unlock()
	return maps.Clone(r.retained.toDrop)
}

// finishedStatuses are pruned at their kind's retention, or Retention.
var finishedStatuses = []string{"succeeded", "discarded", "cancelled"}

// pruneKinds prunes each kind's finished jobs, status by status, at the
// retention in force for it: each a range of one index, however long
// other kinds keep theirs.
func (r *Reconciler) pruneKinds(ctx context.Context, now ledger.Now) (int, error) {
	ps, err := ledger.Retention(ctx, r.pool)
	if err != nil {
		return 0, err
	}
	kinds, err := ledger.FinishedKinds(ctx, r.pool)
	if err != nil {
		return 0, err
	}
	total := 0
	for _, kind := range kinds {
		for _, status := range finishedStatuses {
			keep := r.cfg.Retention
			if p, ok := ledger.InForce(ps, kind, status); ok {
				keep = p.Keep
			}
			if keep <= 0 {
				continue // kept for ever
			}
			for ctx.Err() == nil {
				n, err := ledger.PruneKind(ctx, r.pool, kind, status, keep, r.cfg.PruneBatch, now)
				total += n
				r.retained.add(kind, status, n)
				if err != nil {
					return total, err
				}
				if n < r.cfg.PruneBatch {
					break
				}
			}
		}
	}
	return total, nil
}

// boundDeadLetters applies each kind's dead-letter bounds: seen dead
// letters past them are first noticed (alerted, logged), and dropped once
// DeadDropNotice has passed since; unseen ones are never touched. It
// returns how many it dropped.
func (r *Reconciler) boundDeadLetters(ctx context.Context, now ledger.Now) (int, error) {
	ps, err := ledger.Retention(ctx, r.pool)
	if err != nil {
		return 0, err
	}
	toDrop := map[string]int{}
	defer func() {
		r.retained.mu.Lock()
		r.retained.toDrop = toDrop
		r.retained.mu.Unlock()
	}()
	total := 0
	done := map[string]bool{}
	for _, p := range ps {
		if p.Status != "dead" || done[p.Kind] {
			continue
		}
		done[p.Kind] = true
		p, _ = ledger.InForce(ps, p.Kind, "dead")
		if p.Keep <= 0 && p.MaxCount <= 0 {
			continue
		}
		bound := ledger.DeadBound{Kind: p.Kind, Keep: p.Keep, MaxCount: p.MaxCount, Since: p.SetAt}
		for ctx.Err() == nil {
			n, err := ledger.NoticeDeadDrops(ctx, r.pool, bound, r.cfg.PruneBatch, now)
			if err != nil {
				return total, err
			}
			if n > 0 {
				r.cfg.Logger.Warn("keel reconciler: seen dead letters are past their kind's bound and will be dropped",
					"kind", p.Kind, "count", n, "after", r.cfg.DeadDropNotice, "keep", p.Keep, "max_count", p.MaxCount)
			}
			if n < r.cfg.PruneBatch {
				break
			}
		}
		for ctx.Err() == nil {
			n, err := ledger.DropDeadLetters(ctx, r.pool, bound, r.cfg.DeadDropNotice, r.cfg.PruneBatch, now)
			total += n
			r.retained.add(p.Kind, "dead", n)
			if err != nil {
				return total, err
			}
			if n > 0 {
				r.cfg.Logger.Warn("keel reconciler: dropped seen dead letters past their kind's bound",
					"kind", p.Kind, "count", n, "keep", p.Keep, "max_count", p.MaxCount)
			}
			if n < r.cfg.PruneBatch {
				break
			}
		}
		n, err := ledger.DeadToDrop(ctx, r.pool, bound, now)
		if err != nil {
			return total, err
		}
		if n > 0 {
			toDrop[p.Kind] = n
		}
	}
	return total, nil
}
