package inspect

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/keeljobs/keel/internal/jobstore"
	"github.com/keeljobs/keel/internal/ledger"
)

// KindPause is a kind a person paused: who, when, why, and how many of its
// jobs the ledger holds.
type KindPause = ledger.KindPause

// PauseKind pauses kind on every worker. asynq pauses whole queues only,
// so keel holds the kind's jobs in the ledger: each that waits for a run
// gets the status paused now, and one delivered later (enqueued during the
// pause, or published before it) is held at its claim and its delivery
// acknowledged. A running job finishes. Nothing of it lives in Redis, so
// a Redis that loses its data and workers that restart keep the pause. It
// reports false when the kind was paused already (nothing is audited; the
// kind's waiting jobs are held all the same).
func (in *Inspector) PauseKind(ctx context.Context, kind, actor, note string) (bool, error) {
	if err := kindAction(kind, actor); err != nil {
		return false, err
	}
	var changed bool
	err := pgx.BeginFunc(ctx, in.pool, func(tx pgx.Tx) error {
		var err error
		if changed, err = ledger.PauseKind(ctx, tx, kind, actor, note); err != nil {
			return err
		}
		_, err = ledger.HoldKind(ctx, tx, kind)
		return err
	})
	return changed, interpret(err)
}

// ResumeKind lets workers run kind's jobs again: the jobs it held go back
// to the relay, which publishes them once, each at its time. It reports
// false when the kind was not paused.
func (in *Inspector) ResumeKind(ctx context.Context, kind, actor, note string) (bool, error) {
	if err := kindAction(kind, actor); err != nil {
		return false, err
	}
	var changed bool
	err := pgx.BeginFunc(ctx, in.pool, func(tx pgx.Tx) error {
		var err error
		if changed, err = ledger.ResumeKind(ctx, tx, kind, actor, note); err != nil {
			return err
		}
		// A statement of its own: it waits for the holds that locked the
		// pause, and then sees them (see internal/ledger/kindpauses.go).
		// Any jobs held without a pause are released too.
		n, err := ledger.ReleaseKind(ctx, tx, kind)
		if err != nil || n == 0 {
			return err
		}
		return jobstore.NotifyRelay(ctx, tx)
	})
	return changed, interpret(err)
}

// PausedKinds returns the kinds the ledger holds paused, by name, with the
// number of jobs each holds.
func (in *Inspector) PausedKinds(ctx context.Context) ([]KindPause, error) {
	ps, err := ledger.KindPauses(ctx, in.pool)
	return ps, interpret(err)
}

func kindAction(kind, actor string) error {
	if err := needActor(actor); err != nil {
		return err
	}
	if err := ledger.ValidateKey("kind", kind); err != nil {
		return fmt.Errorf("keel: %w: %w", ErrInvalidName, err)
	}
	return nil
}
