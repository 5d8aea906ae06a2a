// Package outcome carries, in a delivery's context, what keel's guard did
// with it when the error it returns does not say it (a duplicate
// acknowledged, a run cancelled, interrupted, given up, a poison job
// retired), to the worker's per-attempt log line.
package outcome

import (
	"context"
	"sync/atomic"
)

// Outcome is what the guard did with a delivery when the error it returns
// does not say it: the worker's per-attempt log line (server.Log) reads it.
type Outcome int

const (
	// Handled: the returned error (nil or not) is the run's outcome.
	Handled Outcome = iota
	// Duplicate: the job had already finished; the delivery was
	// acknowledged and nothing ran.
	Duplicate
	// Cancelled: the job was cancelled; its run was stopped and
	// nothing of it recorded.
	Cancelled
	// Interrupted: the worker's shutdown cut the run short; the job
	// is pending again, its attempt not counted.
	Interrupted
	// GivenUp: keel gave the run up (past its deadline and grace, or
	// at shutdown) and recorded its outcome before the handler returned.
	GivenUp
	// Retired: the job's runs kept ending without an outcome; it was
	// retired as a poison job (dead, class crashed) and nothing ran.
	Retired
	// Held: the job's kind is paused; the ledger holds it until the
	// kind resumes, the delivery was acknowledged and nothing ran.
	Held
)

type outcomeKey struct{}

// With returns ctx with a place where the guard notes the
// delivery's Outcome, and the function that reads it once the guard
// returns. It is noted from more than one goroutine (the handler's, the
// timeout watchdog's), so it is kept atomically.
func With(ctx context.Context) (context.Context, func() Outcome) {
	var o atomic.Int32
	return context.WithValue(ctx, outcomeKey{}, &o), func() Outcome { return Outcome(o.Load()) }
}

// Note notes o as the outcome of ctx's delivery.
func Note(ctx context.Context, o Outcome) {
	if p, ok := ctx.Value(outcomeKey{}).(*atomic.Int32); ok {
		p.Store(int32(o))
	}
}
