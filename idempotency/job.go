package idempotency

import (
	"github.com/keeljobs/keel/internal/ledger"
)

// Status is where a job stands in its life: pending → running → succeeded
// | failed (will retry) | dead (waits for a person) → replayed (pending) or
// discarded; a job not yet finished may be cancelled.
type Status = ledger.Status

// The ledger's statuses.
const (
	StatusPending   = ledger.StatusPending
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
