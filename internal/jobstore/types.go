package jobstore

import "github.com/keeljobs/keel/internal/ledger"

// The ledger's row types, named here as the store's callers read them.
type (
	Job        = ledger.Job
	Status     = ledger.Status
	StepRecord = ledger.StepRecord
	DB         = ledger.DB
)

const (
	StatusPending   = ledger.StatusPending
	StatusRunning   = ledger.StatusRunning
	StatusSucceeded = ledger.StatusSucceeded
	StatusFailed    = ledger.StatusFailed
	StatusDead      = ledger.StatusDead
	StatusDiscarded = ledger.StatusDiscarded
	StatusCancelled = ledger.StatusCancelled
)
