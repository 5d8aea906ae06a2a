package executor

import (
	"errors"

	"github.com/keeljobs/keel/internal/jobstore"
	"github.com/keeljobs/keel/internal/pgerr"
)

var (
	// ErrNoJob is idempotency.ErrNoJob.
	ErrNoJob = errors.New("keel: no ledger job in context (is the idempotency middleware installed?)")
	// ErrLeaseHeld is idempotency.ErrLeaseHeld.
	ErrLeaseHeld = errors.New("keel: another worker holds this job's lease")
	// ErrLeaseLost is idempotency.ErrLeaseLost.
	ErrLeaseLost = errors.New("keel: lease lost; this attempt's transaction was rolled back")
	// ErrInDoubt is idempotency.ErrInDoubt.
	ErrInDoubt = errors.New("in doubt: needs a person")
	// ErrCallInFlight is idempotency.ErrCallInFlight.
	ErrCallInFlight = errors.New("keel: a call of this step from an earlier run may still be in flight")
	// ErrGuardClosed is idempotency.ErrGuardClosed.
	ErrGuardClosed = errors.New("keel: ledger guard closed")
	// ErrRunGivenUp is idempotency.ErrRunGivenUp.
	ErrRunGivenUp = errors.New("keel: this run was given up (timed out or interrupted); its work cannot commit")
	// ErrAlreadyCompleted is idempotency.ErrAlreadyCompleted.
	ErrAlreadyCompleted = errors.New("already completed by an earlier InTx: this one did not run (one completing InTx per job, last)")
	// ErrCancelled is idempotency.ErrCancelled.
	ErrCancelled = errors.New("keel: job cancelled; this run's work cannot commit")
	// ErrUnknownJob is idempotency.ErrUnknownJob.
	ErrUnknownJob = errors.New("keel: task has no ledger row (enqueue through keel, not plain asynq)")
)

// interpretError is the one place pgx errors become keel's.
func interpretError(err error) error { return jobstore.Interpret(err) }

func ledgerUnreachable(err error) bool { return pgerr.Unreachable(err) }

func lockConflict(err error) bool { return pgerr.LockConflict(err) }

func storableText(s string, max int) string { return jobstore.StorableText(s, max) }

const maxErrorBytes = jobstore.MaxErrorBytes
