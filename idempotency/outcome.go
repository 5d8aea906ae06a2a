package idempotency

import (
	"context"
	"sync/atomic"
)

// Outcome is what the guard did with a delivery when the error it returns
// does not say it: the worker's per-attempt log line (server.Log) reads it.
type Outcome int

const (
	// OutcomeHandled: the returned error (nil or not) is the run's outcome.
	OutcomeHandled Outcome = iota
	// OutcomeDuplicate: the job had already finished; the delivery was
	// acknowledged and nothing ran.
	OutcomeDuplicate
	// OutcomeCancelled: the job was cancelled; its run was stopped and
	// nothing of it recorded.
	OutcomeCancelled
	// OutcomeInterrupted: the worker's shutdown cut the run short; the job
	// is pending again, its attempt not counted.
	OutcomeInterrupted
	// OutcomeGivenUp: keel gave the run up (past its deadline and grace, or
	// at shutdown) and recorded its outcome before the handler returned.
	OutcomeGivenUp
	// OutcomeRetired: the job's runs kept ending without an outcome; it was
	// retired as a poison job (dead, class crashed) and nothing ran.
	OutcomeRetired
)

type outcomeKey struct{}

// WithOutcome returns ctx with a place where the guard notes the
// delivery's Outcome, and the function that reads it once the guard
// returns. It is noted from more than one goroutine (the handler's, the
// timeout watchdog's), so it is kept atomically.
func WithOutcome(ctx context.Context) (context.Context, func() Outcome) {
	var o atomic.Int32
	return context.WithValue(ctx, outcomeKey{}, &o), func() Outcome { return Outcome(o.Load()) }
}

func noteOutcome(ctx context.Context, o Outcome) {
	if p, ok := ctx.Value(outcomeKey{}).(*atomic.Int32); ok {
		p.Store(int32(o))
	}
}
