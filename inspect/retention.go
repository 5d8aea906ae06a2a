package inspect

import (
	"context"
	"fmt"

	"github.com/keeljobs/keel/internal/ledger"
)

// RetentionPolicy is one kind's retention for one status: who set it (a
// person, or the kind's code through tasks.Keep), how long its jobs are
// kept (Keep; 0: for ever) and, for dead letters, how many (MaxCount; 0:
// no bound).
type RetentionPolicy = ledger.Policy

// Sources of a retention policy; a person's is in force over the code's.
const (
	SourcePerson = ledger.SourcePerson
	SourceCode   = ledger.SourceCode
)

// MinRetention is the shortest Keep a policy may set: a finished job's row
// dedupes its business key, and pruned, the key makes a new job.
const MinRetention = ledger.MinKeep

// SetRetention records p (its Kind, Status, Keep and, for dead letters,
// MaxCount) as a person's policy, in force over the kind's code, by actor
// with note, audited. Reconcilers apply it at their next prune.
func (in *Inspector) SetRetention(ctx context.Context, p RetentionPolicy, actor, note string) error {
	if err := needActor(actor); err != nil {
		return err
	}
	if err := ledger.ValidatePolicy(p); err != nil {
		return fmt.Errorf("keel: %w", err)
	}
	return interpret(ledger.SetRetention(ctx, in.pool, p, actor, note, nil))
}

// UnsetRetention deletes a person's policy for kind and status, audited;
// the kind's code policy, or the reconciler's Retention, is in force
// again. It reports false when there was none.
func (in *Inspector) UnsetRetention(ctx context.Context, kind, status, actor, note string) (bool, error) {
	if err := needActor(actor); err != nil {
		return false, err
	}
	changed, err := ledger.UnsetRetention(ctx, in.pool, kind, status, actor, note, nil)
	return changed, interpret(err)
}

// Retention returns every recorded policy, by kind and status, a person's
// (the one in force) before the code's. Kinds and statuses without one keep
// the reconciler's Retention; dead letters without one are kept for ever.
func (in *Inspector) Retention(ctx context.Context) ([]RetentionPolicy, error) {
	ps, err := ledger.Retention(ctx, in.pool)
	return ps, interpret(err)
}

// RetentionInForce returns the policy in force for kind's jobs of status
// among ps (as Retention returns them), false when none is.
func RetentionInForce(ps []RetentionPolicy, kind, status string) (RetentionPolicy, bool) {
	return ledger.InForce(ps, kind, status)
}

// MarkSeen records that actor was shown the dead letters among ids, and
// returns how many had not been seen since they died. Only a seen dead
// letter is ever dropped by its kind's bounds: the dashboard's job page,
// and `keel dead show` and `keel status` printing one for a person, call
// it; so may a program that shows dead letters to people.
func (in *Inspector) MarkSeen(ctx context.Context, ids []string, actor string) (int, error) {
	if err := needActor(actor); err != nil {
		return 0, err
	}
	n, err := ledger.MarkSeen(ctx, in.pool, ids, actor, nil)
	return n, interpret(err)
}
