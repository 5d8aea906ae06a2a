package executor

import "github.com/keeljobs/keel/internal/ledger"

// The ledger's row types, as handlers and the guard read them.
type (
	Job        = ledger.Job
	Status     = ledger.Status
	StepRecord = ledger.StepRecord
)
