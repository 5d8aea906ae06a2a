package idempotency

import (
	"github.com/keeljobs/keel/internal/executor"
	"github.com/keeljobs/keel/internal/jobstore"
)

// The errors a handler sees: compare with errors.Is.
var (
	// ErrNoJob means a ledger helper (Step, InTx) was called outside a handler
	// run by the ledger middleware.
	ErrNoJob = executor.ErrNoJob
	// ErrLeaseHeld means another worker is running this job right now.
	ErrLeaseHeld = executor.ErrLeaseHeld
	// ErrLeaseLost means this worker's lease expired and another may have taken
	// the job over; the work of this attempt was not committed.
	ErrLeaseLost = executor.ErrLeaseLost
	// ErrInDoubt means a recorded step started but its outcome was never
	// recorded (the process died mid-call) and there is no way to verify it.
	// The job is parked in the dead letters for a person: never a blind repeat.
	ErrInDoubt = executor.ErrInDoubt
	// ErrCallInFlight means a step's call made by an earlier run of the job
	// (given up at its timeout, say) may still be in flight: the step is
	// neither verified nor called again until that call's outcome is
	// recorded or its worker is known dead. It comes as a wait: no attempt
	// is spent.
	ErrCallInFlight = executor.ErrCallInFlight
	// ErrGuardClosed means the worker's ledger guard has stopped (the worker
	// shut down) while a handler was still running; its outcome is left to
	// the lease and the next delivery.
	ErrGuardClosed = executor.ErrGuardClosed
	// ErrRunGivenUp means keel gave this run of the job up (its handler
	// outlived its timeout, or the worker shut down) and recorded its outcome;
	// nothing the handler does from then on is committed.
	ErrRunGivenUp = executor.ErrRunGivenUp
	// ErrAlreadyCompleted means a second InTx ran after the one that
	// completed the job: it did not run, and the job is not reported
	// succeeded without the work that came after its completion.
	ErrAlreadyCompleted = executor.ErrAlreadyCompleted
	// ErrCancelled means the job was cancelled while this run went on: its
	// InTx and Step are refused, so nothing it does from then on commits.
	ErrCancelled = executor.ErrCancelled
	// ErrUnknownJob means a task arrived whose id has no ledger row.
	ErrUnknownJob = executor.ErrUnknownJob
	// ErrNotFound means no ledger row matches.
	ErrNotFound = jobstore.ErrNotFound
	// ErrNoResult means a job has no result: it has not succeeded (yet),
	// or its handler stored none. The error names the job's status.
	ErrNoResult = jobstore.ErrNoResult
	// ErrResultTooLarge refuses a result over MaxResultBytes as JSON.
	ErrResultTooLarge = executor.ErrResultTooLarge
	// ErrRunEnded means Progress was called after the handler returned
	// (from a goroutine it left behind): nothing is written.
	ErrRunEnded = executor.ErrRunEnded
	// ErrPastDeadline refuses a job that would run at or after its
	// deadline (a delay or run time past it, or a deadline already gone):
	// it could never run.
	ErrPastDeadline = jobstore.ErrPastDeadline
	// ErrLedgerUnavailable means Postgres could not be reached or dropped
	// the connection (a restart, a failover, a cut connection). Such errors
	// are marked retry.Wait: a job that meets one in InTx or Step waits and
	// runs again, without using up an attempt.
	ErrLedgerUnavailable = jobstore.ErrLedgerUnavailable
	// ErrNotSent marks a step's error as one that happened before the call
	// left this process (see NotSent).
	ErrNotSent = executor.ErrNotSent
	// ErrStepAfterComplete means Step or StepValue was called after the
	// job's completing InTx had committed: the step did not run. Call steps
	// first and the completing InTx last.
	ErrStepAfterComplete = executor.ErrStepAfterComplete
	// ErrResent means the HTTP client sent a step's request a second time
	// before any answer to the first (a retrying RoundTripper, say): the call
	// may have taken effect twice. DoHTTP reports it in doubt and permanent, for
	// a person to check.
	ErrResent = executor.ErrResent
)

// HeaderIdempotencyKey is the header DoHTTP and StepHTTP send a step's key in.
const HeaderIdempotencyKey = executor.HeaderIdempotencyKey
