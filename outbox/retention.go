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

// pruneKinds prunes each kind's finished jobs, status by status, at the
// retention in force for it (plan, which Prunable counts by too): each a
// range of one index, however long other kinds keep theirs.
func (r *Reconciler) pruneKinds(ctx context.Context, plan []ledger.KindKeep, now ledger.Now) (int, error) {
	total := 0
	for _, k := range plan {
		for ctx.Err() == nil {
			n, err := ledger.PruneKind(ctx, r.pool, k.Kind, k.Status, k.Keep, r.cfg.PruneBatch, now)
			total += n
			r.retained.add(k.Kind, k.Status, n)
			if err != nil {
				return total, err
			}
			if n < r.cfg.PruneBatch {
				break
			}
		}
	}
	return total, nil
}

// boundDeadLetters applies each kind's dead-letter bounds: seen dead
// letters past them are first noticed (alerted, logged), and dropped once
// DeadDropNotice has passed since; unseen ones are never touched. It
// returns how many it dropped.
func (r *Reconciler) boundDeadLetters(ctx context.Context, bounds []ledger.DeadBound, now ledger.Now) (int, error) {
	toDrop := map[string]int{}
	defer func() {
		r.retained.mu.Lock()
		r.retained.toDrop = toDrop
		r.retained.mu.Unlock()
	}()
	total := 0
	for _, bound := range bounds {
		for ctx.Err() == nil {
			n, err := ledger.NoticeDeadDrops(ctx, r.pool, bound, r.cfg.PruneBatch, now)
			if err != nil {
				return total, err
			}
			if n > 0 {
				r.cfg.Logger.Warn("keel reconciler: seen dead letters are past their kind's bound and will be dropped",
					"kind", bound.Kind, "count", n, "after", r.cfg.DeadDropNotice, "keep", bound.Keep, "max_count", bound.MaxCount)
			}
			if n < r.cfg.PruneBatch {
				break
			}
		}
		for ctx.Err() == nil {
			n, err := ledger.DropDeadLetters(ctx, r.pool, bound, r.cfg.DeadDropNotice, r.cfg.PruneBatch, now)
			total += n
			r.retained.add(bound.Kind, "dead", n)
			if err != nil {
				return total, err
			}
			if n > 0 {
				r.cfg.Logger.Warn("keel reconciler: dropped seen dead letters past their kind's bound",
					"kind", bound.Kind, "count", n, "keep", bound.Keep, "max_count", bound.MaxCount)
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
			toDrop[bound.Kind] = n
		}
	}
	return total, nil
}
