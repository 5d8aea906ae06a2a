package inspect

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/keeljobs/keel/internal/asynqwire"
	"github.com/keeljobs/keel/internal/jobstore"
	"github.com/keeljobs/keel/internal/ledger"
)

// ErrNoRedis means a queue action was asked of an Inspector without Redis
// (Config.Redis or RedisClient).
var ErrNoRedis = errors.New("keel inspect: pausing a queue needs Redis (Config.Redis)")

// ErrInvalidName means a queue or kind name a pause was asked for cannot
// name one.
var ErrInvalidName = errors.New("invalid name")

// QueuePause is a queue a person paused: who, when and why.
type QueuePause = ledger.Pause

// PauseQueue pauses queue on every worker: no worker starts its jobs, a
// running one finishes, and everything waiting in it stays there, visible,
// until ResumeQueue. The pause is the ledger's (audited) before it is
// Redis's, so a Redis that loses its data gets it back at the next
// reconciler pass, and a worker that restarts finds it; a job delivered
// meanwhile is held in the ledger at its claim (status paused) until the
// resume. It reports false
// when the queue was paused already (nothing is changed or audited).
func (in *Inspector) PauseQueue(ctx context.Context, queue, actor, note string) (bool, error) {
	if err := in.queueAction(queue, actor); err != nil {
		return false, err
	}
	changed, err := ledger.PauseQueue(ctx, in.pool, queue, actor, note)
	if err != nil {
		return false, interpret(err)
	}
	// Paused already in the ledger: Redis may have lost it since.
	if _, err := asynqwire.Pause(ctx, in.rdb, queue, time.Now()); err != nil {
		return changed, fmt.Errorf("keel: queue %s is paused in the ledger, and a reconciler pass pauses it in Redis (now: %w)", queue, err)
	}
	return changed, nil
}

// ResumeQueue lets workers take queue's jobs again. The ledger's pause
// is deleted in a transaction that commits only once Redis has the pause
// lifted: should Redis fail, the ledger still says paused and nothing
// changed, and a reconciler pass applying the pause meanwhile finishes
// before the resume lifts it. It reports false when the ledger had no
// pause of the queue (a pause made in Redis alone, by asynq's own tools,
// is lifted all the same).
func (in *Inspector) ResumeQueue(ctx context.Context, queue, actor, note string) (bool, error) {
	if err := in.queueAction(queue, actor); err != nil {
		return false, err
	}
	var changed bool
	var redisErr error
	err := pgx.BeginFunc(ctx, in.pool, func(tx pgx.Tx) error {
		var err error
		if changed, err = ledger.ResumeQueue(ctx, tx, queue, actor, note); err != nil {
			return err
		}
		// Jobs held at their claims while Redis had lost the pause; a
		// statement of its own, as ResumeKind's release.
		n, err := ledger.ReleaseQueue(ctx, tx, queue)
		if err != nil {
			return err
		}
		if n > 0 {
			if err := jobstore.NotifyRelay(ctx, tx); err != nil {
				return err
			}
		}
		_, redisErr = asynqwire.Unpause(ctx, in.rdb, queue)
		return redisErr
	})
	if redisErr != nil {
		return false, fmt.Errorf("keel: resume queue %s: %w", queue, redisErr)
	}
	if err != nil {
		return false, interpret(err)
	}
	return changed, nil
}

// PausesHolding reports whether kind and queue are paused in the ledger:
// which pauses hold a job of theirs that the ledger holds (status paused).
func (in *Inspector) PausesHolding(ctx context.Context, kind, queue string) (kindPaused, queuePaused bool, err error) {
	kindPaused, queuePaused, err = ledger.PausesHolding(ctx, in.pool, kind, queue)
	return kindPaused, queuePaused, interpret(err)
}

// PausedQueues returns the queues the ledger holds paused, by name.
func (in *Inspector) PausedQueues(ctx context.Context) ([]QueuePause, error) {
	ps, err := ledger.Pauses(ctx, in.pool)
	return ps, interpret(err)
}

func (in *Inspector) queueAction(queue, actor string) error {
	if err := needActor(actor); err != nil {
		return err
	}
	if err := ledger.ValidateQueue(queue); err != nil {
		return fmt.Errorf("keel: %w: %w", ErrInvalidName, err)
	}
	if in.rdb == nil {
		return ErrNoRedis
	}
	return nil
}
