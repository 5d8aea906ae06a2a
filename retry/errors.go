package retry

import (
	"errors"
	"fmt"
	"time"
)

// Class says what a failure means for the job's future.
type Class string

const (
	// ClassUnknown is an error nobody marked and no rule recognised: a few
	// retries, then the dead letters, with the full context kept.
	ClassUnknown Class = "unknown"
	// ClassTransient will probably go away by itself: retry with backoff.
	ClassTransient Class = "transient"
	// ClassPermanent will fail the same way every time: no retry, dead at once.
	ClassPermanent Class = "permanent"
	// ClassWait is not a failure at all: the job could not start (a rate limit,
	// a concurrency slot, another worker's lease) and tries again later without
	// using up an attempt.
	ClassWait Class = "wait"
)

// Error is a failure marked by the code that saw it. Handlers build it with
// Permanent, Transient, After or Wait; the rest of keel reads it with errors.As.
type Error struct {
	Class Class
	// Delay, when positive, is how long the other side asked us to wait
	// (HTTP Retry-After, a lease's remaining time). It overrides the backoff.
	Delay time.Duration
	Err   error
}

func (e *Error) Error() string {
	if e.Err == nil {
		return string(e.Class)
	}
	return e.Err.Error()
}

func (e *Error) Unwrap() error { return e.Err }

// Is lets errors.Is(err, retry.ErrPermanent) and friends match any marked
// error of that class. It matches a mark anywhere in the chain; Marked and
// Classify go by the outermost, so use them to decide what happens.
func (e *Error) Is(target error) bool {
	t, ok := target.(*Error)
	return ok && t.Err == nil && t.Class == e.Class
}

// Sentinels for errors.Is: errors.Is(err, retry.ErrPermanent).
var (
	ErrPermanent = &Error{Class: ClassPermanent}
	ErrTransient = &Error{Class: ClassTransient}
	ErrWait      = &Error{Class: ClassWait}
)

// Permanent marks err as one that retrying cannot fix (bad input, a business
// rule, a 4xx). The job goes to the dead letters at once.
func Permanent(err error) error { return mark(ClassPermanent, 0, err) }

// Transient marks err as one that will probably pass (a timeout, a 5xx).
func Transient(err error) error { return mark(ClassTransient, 0, err) }

// After marks err as transient with a wait the other side asked for, such as
// an HTTP 429's Retry-After. The next attempt is not earlier than d.
func After(d time.Duration, err error) error { return mark(ClassTransient, d, err) }

// Wait says the job could not start yet and should be tried again after d
// without counting an attempt (rate limits, concurrency slots, leases).
func Wait(d time.Duration, err error) error { return mark(ClassWait, d, err) }

func mark(c Class, d time.Duration, err error) error {
	if err == nil {
		err = fmt.Errorf("%s failure", c)
	}
	return &Error{Class: c, Delay: d, Err: err}
}

// Marked returns the outermost mark on err, if any.
func Marked(err error) (*Error, bool) {
	var e *Error
	if errors.As(err, &e) {
		return e, true
	}
	return nil, false
}

// IsWait reports whether err only postpones the job (it does not count as a
// failed attempt). It is what keel's server passes to asynq as IsFailure's
// negation.
func IsWait(err error) bool {
	e, ok := Marked(err)
	return ok && e.Class == ClassWait
}

// Classes the ledger records for outcomes no handler returned: keel decides
// them itself, and they are never the result of Classify.
const (
	// ClassTimeout: the handler outlived its timeout (and a short grace)
	// without returning; the attempt counts as failed.
	ClassTimeout Class = "timeout"
	// ClassCrashed: runs of the job ended without any outcome (the worker
	// died: out of memory, os.Exit, a segfault, SIGKILL) until its budget
	// was used up: a poison job.
	ClassCrashed Class = "crashed"
	// ClassWaitedTooLong: the job waited (rate limits, Retry-After) longer in
	// total than its wait ceiling.
	ClassWaitedTooLong Class = "waited_too_long"
	// ClassDeadline: the job's deadline (tasks.Deadline) passed before a run
	// could start — a backlog, a retry that would come after it: dead.
	ClassDeadline Class = "deadline"
	// ClassExpired: the same for a kind that drops stale work
	// (tasks.ExpireAtDeadline): the job is discarded, not dead, and raises
	// no alert.
	ClassExpired Class = "expired"
)

// StoredClasses are every class a dead job can carry in the ledger, for
// filters that must refuse a class that does not exist.
func StoredClasses() []Class {
	return []Class{ClassPermanent, ClassTransient, ClassUnknown, ClassTimeout, ClassCrashed, ClassWaitedTooLong, ClassDeadline}
}
