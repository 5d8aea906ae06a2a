package idempotency

import (
	"github.com/keeljobs/keel/internal/executor"
	"github.com/keeljobs/keel/internal/jobstore"
	"github.com/keeljobs/keel/internal/ledger"
)

// Status is where a job stands in its life: pending → running → succeeded
// | failed (will retry) | dead (waits for a person) → replayed (pending) or
// discarded; a job not yet finished may be cancelled.
type Status = ledger.Status

// The ledger's statuses.
const (
	// StatusWaiting: the job waits for other jobs to succeed (tasks.After).
	StatusWaiting = ledger.StatusWaiting
	StatusPending = ledger.StatusPending
	// StatusPaused: the job's kind is paused (inspect.PauseKind), or its
	// queue is (inspect.PauseQueue) and Redis, which had lost the pause,
	// delivered it; it runs when the pause ends.
	StatusPaused    = ledger.StatusPaused
	StatusRunning   = ledger.StatusRunning
	StatusSucceeded = ledger.StatusSucceeded
	StatusFailed    = ledger.StatusFailed
	StatusDead      = ledger.StatusDead
	StatusDiscarded = ledger.StatusDiscarded
	StatusCancelled = ledger.StatusCancelled
)

// Job is one ledger row.
type Job = ledger.Job

// StepRecord is one recorded external side effect of a job.
type StepRecord = ledger.StepRecord

// JobProgress is a job's progress as its handler last reported it
// (Progress); Run is the run that reported it.
type JobProgress = ledger.JobProgress

// JobResult is a succeeded job's result (SetResult), as JSON; Decode
// unmarshals it.
type JobResult = ledger.JobResult

// DeadEvent describes a job that has just died (or expired at its
// deadline): what server.GuardConfig.OnDead and OnExpired, and the
// reconciler's OnDead, are called with.
type DeadEvent = jobstore.DeadEvent

// CancelEvent describes a run the guard stopped because its job was
// cancelled (server.GuardConfig.OnCancelled).
type CancelEvent = executor.CancelEvent
