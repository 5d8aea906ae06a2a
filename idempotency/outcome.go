package idempotency

import "context"

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
)

type outcomeKey struct{}

// WithOutcome returns ctx with a place where the guard notes the
// delivery's Outcome, read through the returned pointer once the guard
// returns.
func WithOutcome(ctx context.Context) (context.Context, *Outcome) {
	o := new(Outcome)
	return context.WithValue(ctx, outcomeKey{}, o), o
}

func noteOutcome(ctx context.Context, o Outcome) {
	if p, ok := ctx.Value(outcomeKey{}).(*Outcome); ok {
		*p = o
	}
}
