package idempotency

import (
	"errors"
	"unicode/utf8"

	"github.com/keeljobs/keel/internal/jobstore"
	"github.com/keeljobs/keel/internal/pgerr"
)

var (
	// ErrNotFound means no ledger row matches.
	ErrNotFound = jobstore.ErrNotFound
	// ErrNoJob means a ledger helper (Step, InTx) was called outside a handler
	// run by the ledger middleware.
	ErrNoJob = errors.New("keel: no ledger job in context (is the idempotency middleware installed?)")
	// ErrLeaseHeld means another worker is running this job right now.
	ErrLeaseHeld = errors.New("keel: another worker holds this job's lease")
	// ErrLeaseLost means this worker's lease expired and another may have taken
	// the job over; the work of this attempt was not committed.
	ErrLeaseLost = errors.New("keel: lease lost; this attempt's transaction was rolled back")
	// ErrInDoubt means a recorded step started but its outcome was never
	// recorded (the process died mid-call) and there is no way to verify it.
	// The job is parked in the dead letters for a person: never a blind repeat.
	ErrInDoubt = errors.New("in doubt: needs a person")
	// ErrCallInFlight means a step's call made by an earlier run of the job
	// (given up at its timeout, say) may still be in flight: the step is
	// neither verified nor called again until that call's outcome is
	// recorded or its worker is known dead. It comes as a wait: no attempt
	// is spent.
	ErrCallInFlight = errors.New("keel: a call of this step from an earlier run may still be in flight")
	// ErrPastDeadline refuses a job that would run at or after its
	// deadline (a delay or run time past it, or a deadline already gone):
	// it could never run.
	ErrPastDeadline = jobstore.ErrPastDeadline
	// ErrGuardClosed means the worker's ledger guard has stopped (the worker
	// shut down) while a handler was still running; its outcome is left to
	// the lease and the next delivery.
	ErrGuardClosed = errors.New("keel: ledger guard closed")
	// ErrRunGivenUp means keel gave this run of the job up (its handler
	// outlived its timeout, or the worker shut down) and recorded its outcome;
	// nothing the handler does from then on is committed.
	ErrRunGivenUp = errors.New("keel: this run was given up (timed out or interrupted); its work cannot commit")
	// ErrAlreadyCompleted means a second InTx ran after the one that
	// completed the job: it did not run, and the job is not reported
	// succeeded without the work that came after its completion.
	ErrAlreadyCompleted = errors.New("already completed by an earlier InTx: this one did not run (one completing InTx per job, last)")
	// ErrCancelled means the job was cancelled while this run went on: its
	// InTx and Step are refused, so nothing it does from then on commits.
	ErrCancelled = errors.New("keel: job cancelled; this run's work cannot commit")
	// ErrUnknownJob means a task arrived whose id has no ledger row.
	ErrUnknownJob = errors.New("keel: task has no ledger row (enqueue through keel, not plain asynq)")
	// ErrLedgerUnavailable means Postgres could not be reached or dropped
	// the connection (a restart, a failover, a cut connection). Such errors
	// are marked retry.Wait: a job that meets one in InTx or Step waits and
	// runs again, without using up an attempt.
	ErrLedgerUnavailable = jobstore.ErrLedgerUnavailable
)

// interpretError is the one place pgx errors become keel's.
func interpretError(err error) error { return jobstore.Interpret(err) }

func ledgerUnreachable(err error) bool { return pgerr.Unreachable(err) }

func lockConflict(err error) bool { return pgerr.LockConflict(err) }

func isUndefinedTable(err error) bool { return pgerr.UndefinedTable(err) }

func utf8Valid(s string) bool { return utf8.ValidString(s) }

func storableText(s string, max int) string { return jobstore.StorableText(s, max) }

const maxErrorBytes = jobstore.MaxErrorBytes
