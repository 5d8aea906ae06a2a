package jobstore

import "github.com/keeljobs/keel/internal/ledger"

// The ledger's row types, named here as the store's callers read them.
type (
	Job        = ledger.Job
	Status     = ledger.Status
	StepRecord = ledger.StepRecord
	DB         = ledger.DB
)
