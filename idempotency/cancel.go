package idempotency

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
)

// ErrNotCancellable means a cancel named a job that has already ended
// (succeeded, dead, discarded): there is nothing left to stop. The error
// names the job's status.
var ErrNotCancellable = errors.New("keel: job cannot be cancelled")

// CancelResult says what a cancel did.
type CancelResult struct {
	// Job is the ledger row after the cancel.
	Job Job
	// AlreadyCancelled is true when the job was cancelled before (by an
	// earlier call or someone else); nothing was changed or audited.
	AlreadyCancelled bool
	// WasRunning is true when a worker held the job: its handler's context
	// is cancelled (asynq's CancelProcessing, and the guard at its next
	// lease renewal should that message be lost).
	WasRunning bool
	// RedisErr is why asynq's copy could not be removed or stopped, if it
	// could not. The cancel holds anyway: the ledger is the record, and a
	// worker acknowledges any later delivery without running it.
	RedisErr error
}

// Cancel closes a job that has not finished (pending, scheduled, failed and
// waiting for its retry, or running) for good, with who did it and why in
// the audit log. A job not running has its asynq task removed; a running
// job's handler context is cancelled and nothing that run does later can
// commit (its InTx and Step return ErrCancelled). The cancel does not undo
// anything: a step whose call already left stays as it is, in doubt if it
// had not finished.
//
// Cancelling a cancelled job is a no-op (AlreadyCancelled); a job that has
// already ended is refused with ErrNotCancellable. insp may be nil when
// Redis is not to be touched: the job is still never run again, since a
// worker acknowledges any delivery of a cancelled job without running it.
func (s *Store) Cancel(ctx context.Context, insp *asynq.Inspector, id, actor, note string) (CancelResult, error) {
	if strings.TrimSpace(actor) == "" {
		return CancelResult{}, ErrActorRequired
	}
	var res CancelResult
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		// The row lock orders this cancel against the job's completion (InTx
		// and the guard's mark, both conditional on status = 'running'):
		// whichever commits first wins, and the other changes nothing.
		var status Status
		if err := tx.QueryRow(ctx, `SELECT status FROM keel_jobs WHERE id = $1 FOR UPDATE`, id).Scan(&status); err != nil {
			return interpretError(err)
		}
		switch status {
		case StatusPending, StatusRunning, StatusFailed:
		case StatusCancelled:
			j, err := scanJob(tx.QueryRow(ctx, `SELECT `+jobColumns+` FROM keel_jobs WHERE id = $1`, id))
			res = CancelResult{Job: j, AlreadyCancelled: true}
			return interpretError(err)
		case StatusDead:
			return fmt.Errorf("%w: job %s is dead (it has ended); discard it to close it", ErrNotCancellable, id)
		default:
			return fmt.Errorf("%w: job %s is %s", ErrNotCancellable, id, status)
		}
		// A running handler may act until its worker notices (which then
		// renews the mark while it runs) or its lease runs out: a newer job
		// of the key waits for it (stray_until).
		j, err := scanJob(tx.QueryRow(ctx, `UPDATE keel_jobs SET status = 'cancelled', resolution_note = $2, resolved_by = $3,
			stray_until = CASE WHEN status = 'running' THEN greatest(lease_until, stray_until) ELSE stray_until END,
			lease_holder = NULL, lease_until = NULL, finished_at = now(), updated_at = now()
			WHERE id = $1 RETURNING `+jobColumns, id, note, actor))
		if err != nil {
			return interpretError(err)
		}
		res = CancelResult{Job: j, WasRunning: status == StatusRunning}
		return audit(ctx, tx, id, "cancel", actor, note)
	})
	if err != nil || res.AlreadyCancelled || insp == nil {
		return res, err
	}
	res.RedisErr = stopInRedis(insp, res.Job.Queue, id, res.WasRunning)
	return res, nil
}

// stopInRedis removes a cancelled job's task from asynq, or, when a worker
// has it (running in the ledger, or just dequeued), asks asynq to cancel its
// handler's context. Either may miss (a task in flight between states, a
// lost pub/sub message): the guard's claim and lease renewal see the
// ledger's cancel all the same.
func stopInRedis(insp *asynq.Inspector, queue, id string, running bool) error {
	if !running {
		err := insp.DeleteTask(queue, id)
		if err == nil || errors.Is(err, asynq.ErrTaskNotFound) || errors.Is(err, asynq.ErrQueueNotFound) {
			return nil
		}
		// Most likely active: a worker dequeued it a moment ago.
	}
	if err := insp.CancelProcessing(id); err != nil {
		return fmt.Errorf("keel: cancel the running task %s in asynq: %w", id, err)
	}
	return nil
}

// CancelByKey cancels the job of kind with business key; see Cancel.
func (s *Store) CancelByKey(ctx context.Context, insp *asynq.Inspector, kind, key, actor, note string) (CancelResult, error) {
	j, err := s.Lookup(ctx, kind, key)
	if err != nil {
		return CancelResult{}, err
	}
	return s.Cancel(ctx, insp, j.ID, actor, note)
}
