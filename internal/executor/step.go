package executor

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/keeljobs/keel/internal/jobstore"
	"github.com/keeljobs/keel/internal/ledger"
	"github.com/keeljobs/keel/retry"
)

// StepOption configures one recorded step: an interface, as keel's other
// options are (tasks.Option, tasks.CancelOption).
type StepOption interface{ applyStep(*stepConfig) }

type stepOptionFunc func(*stepConfig)

func (f stepOptionFunc) applyStep(c *stepConfig) { f(c) }

type stepConfig struct {
	verify func(ctx context.Context, key string) (done bool, err error)
}

// Verify is idempotency.Verify.
func Verify(fn func(ctx context.Context, key string) (done bool, err error)) StepOption {
	return stepOptionFunc(func(c *stepConfig) { c.verify = fn })
}

// StepKey is idempotency.StepKey.
func StepKey(jobID, name string) string { return jobID + ":" + name }

// Step is idempotency.Step.
func Step(ctx context.Context, name string, fn func(ctx context.Context, key string) error, opts ...StepOption) error {
	_, err := StepValue(ctx, name, func(ctx context.Context, key string) (struct{}, error) {
		return struct{}{}, fn(ctx, key)
	}, opts...)
	return err
}

// StepValue is idempotency.StepValue.
func StepValue[T any](ctx context.Context, name string, fn func(ctx context.Context, key string) (T, error), opts ...StepOption) (T, error) {
	if jc, err := jobFrom(ctx); err == nil && jc.guard.tracer.On() {
		return tracedStep(ctx, jc, name, fn, opts)
	}
	return stepValue(ctx, name, fn, opts...)
}

func stepValue[T any](ctx context.Context, name string, fn func(ctx context.Context, key string) (T, error), opts ...StepOption) (T, error) {
	var zero T
	jc, err := jobFrom(ctx)
	if err != nil {
		return zero, err
	}
	if jc.completed.Load() {
		// The job is already recorded succeeded: a step now could neither be
		// recorded nor retried, so it must not pretend to run.
		return zero, retry.Permanent(fmt.Errorf("keel: step %q did not run: %w; call steps before InTx", name, ErrStepAfterComplete))
	}
	if err := jc.usable(); err != nil {
		return zero, err
	}
	if err := ledger.ValidateKey("step name", name); err != nil {
		return zero, retry.Permanent(fmt.Errorf("keel: %w", err))
	}
	var cfg stepConfig
	for _, o := range opts {
		o.applyStep(&cfg)
	}
	g := jc.guard
	pool := g.store.Pool()
	key := StepKey(jc.id, name)

	// "started" commits on its own before the call: if the process dies
	// during the call, the next attempt knows the call may have happened.
	// The row names this run as the step's holder and the call as in
	// flight (call_until, renewed while it goes on).
	lease := g.cfg.Lease.Milliseconds()
	run := ledger.StepRun{JobID: jc.id, Name: name, Holder: g.cfg.Holder, Run: jc.run}
	leased, fresh, err := ledger.StartStep(ctx, pool, run, cfg.verify != nil, lease)
	if err != nil {
		return zero, jc.refused(ctx, interpretError(err))
	}
	if !leased {
		return zero, jc.refused(ctx, ErrLeaseLost)
	}
	if !fresh {
		v, done, err := resumeStep[T](ctx, jc, name, key, cfg)
		if err != nil || done {
			return v, err
		}
	}

	// Close lets a call in flight finish and be recorded (callFinishWait);
	// the renewals keep its call_until while it goes on, even past a run
	// given up at its timeout.
	g.calls.enter(true)
	jc.inCall.Add(1)
	call := g.inFlight.add(jc.id, name, jc.run)
	defer func() {
		g.inFlight.remove(call)
		jc.inCall.Add(-1)
		g.calls.leave()
	}()
	v, ferr := callStep(ctx, jc, key, fn)
	bg := context.WithoutCancel(ctx)
	if ferr != nil {
		if !callInDoubt(ferr) {
			// The call never took effect: forget the start so the next
			// attempt calls again, with the same key. Only while this run
			// still holds the step: a newer run's record is not its to erase.
			if err := ledger.ForgetStep(bg, pool, run); err != nil {
				return zero, errors.Join(ferr, interpretError(err))
			}
			return zero, ferr
		}
		// The call may have happened: keep "started" so that it is never
		// repeated blindly; it is no longer in flight, so Verify may settle
		// it now.
		if err := ledger.StepLanded(bg, pool, run); err != nil {
			return zero, errors.Join(inDoubtError(jc.id, name, ferr, cfg.verify != nil), interpretError(err))
		}
		if cfg.verify != nil && errors.Is(ferr, ErrResent) {
			// Verify can say that a call happened, not that it happened
			// once: this one is for a person, not for a replay.
			if err := notVerifiable(bg, pool, jc.id, name); err != nil {
				return zero, errors.Join(inDoubtError(jc.id, name, ferr, true), err)
			}
		}
		return zero, inDoubtError(jc.id, name, ferr, cfg.verify != nil)
	}
	result, err := json.Marshal(v)
	if err != nil {
		return zero, retry.Permanent(fmt.Errorf("keel: step %q result does not encode: %w", name, err))
	}
	// Recorded by the run that holds the step, even one given up while its
	// call went on: no other run verified or called it meanwhile.
	held, err := ledger.StepDone(bg, pool, run, result)
	if err != nil {
		// The call happened but we could not say so: the next attempt finds
		// the step in doubt and verifies it.
		return zero, fmt.Errorf("keel: step %q done but not recorded: %w", name, interpretError(err))
	}
	if !held {
		// Someone removed the step's record, or another run took it over,
		// while the call ran: whether it counts is for a person, not for a
		// silent second call.
		return zero, retry.Permanent(fmt.Errorf("keel: step %q of job %s lost its record during the call: %w", name, jc.id, ErrInDoubt))
	}
	return v, nil
}

// resumeStep handles a step this job started before: its stored result if
// it is done (done true); a wait while an earlier run's call may still be
// in flight; else, the call being in doubt, Verify's word, or the job parked
// for a person. It returns done false when the step is to be called again,
// taken over by this run.
func resumeStep[T any](ctx context.Context, jc *jobContext, name, key string, cfg stepConfig) (T, bool, error) {
	var zero T
	g := jc.guard
	pool := g.store.Pool()
	st, err := ledger.ReadStep(ctx, pool, jc.id, name)
	status, result, inFlight, leftMS := st.Status, st.Result, st.InFlight, st.LeftMS
	if err != nil {
		return zero, false, interpretError(err)
	}
	flightLeft := time.Duration(leftMS) * time.Millisecond
	if status == "done" {
		var v T
		if len(result) > 0 {
			if err := json.Unmarshal(result, &v); err != nil {
				return zero, false, retry.Permanent(fmt.Errorf("keel: step %q: stored result does not decode: %w", name, err))
			}
		}
		return v, true, nil
	}
	if inFlight {
		return zero, false, callInFlight(jc.id, name, flightLeft)
	}
	// Started and never finished: the call may or may not have happened.
	if cfg.verify == nil {
		// This handler cannot Verify it (a build without Verify): a
		// person must, and a replay must not be offered in their place.
		if err := notVerifiable(ctx, pool, jc.id, name); err != nil {
			return zero, false, err
		}
		return zero, false, retry.Permanent(fmt.Errorf("keel: step %q of job %s: %w", name, jc.id, ErrInDoubt))
	}
	// This run takes the step over before it asks Verify: a late outcome
	// of the run that held it can no longer be written.
	run := ledger.StepRun{JobID: jc.id, Name: name, Holder: g.cfg.Holder, Run: jc.run}
	leased, taken, err := ledger.TakeOverStep(ctx, pool, run)
	if err != nil {
		return zero, false, interpretError(err)
	}
	if !leased {
		return zero, false, jc.refused(ctx, ErrLeaseLost)
	}
	if !taken {
		// Its worker renewed the call meanwhile: still in flight.
		return zero, false, callInFlight(jc.id, name, g.cfg.Lease)
	}
	done, err := cfg.verify(ctx, key)
	if err != nil {
		return zero, false, fmt.Errorf("keel: verifying step %q: %w", name, err)
	}
	// Only while this run still holds the job: Verify takes time, and
	// a run that lost the job meanwhile must neither record nor call.
	if done {
		held, err := ledger.StepVerified(ctx, pool, run)
		if err != nil {
			return zero, false, interpretError(err)
		}
		if !held {
			return zero, false, jc.refused(ctx, ErrLeaseLost)
		}
		return zero, true, nil
	}
	held, err := ledger.CallStepAgain(ctx, pool, run, g.cfg.Lease.Milliseconds())
	if err != nil {
		return zero, false, interpretError(err)
	}
	if !held {
		return zero, false, jc.refused(ctx, ErrLeaseLost)
	}
	return zero, false, nil
}

// callInFlight is what a step returns while an earlier run's call of it may
// still be in flight: a wait (no attempt spent) until that call's outcome
// is recorded or its worker is known dead.
func callInFlight(jobID, name string, left time.Duration) error {
	return retry.Wait(max(left+time.Second, time.Second), fmt.Errorf("keel: step %q of job %s: %w", name, jobID, ErrCallInFlight))
}

// callStep makes a step's call. One in flight when asynq cancels the run
// (a deploy's shutdown timeout; the guard's Close waits for it and its
// record, renewing the lease) is let finish: cut off, it would leave the
// step in doubt, and the next worker would park the job for a person. The
// run's other ends still stop it: the job's deadline, a cancel, a lost
// lease, a run given up.
func callStep[T any](ctx context.Context, jc *jobContext, key string, fn func(ctx context.Context, key string) (T, error)) (T, error) {
	g := jc.guard
	cctx, cancel := context.WithCancelCause(context.WithoutCancel(ctx))
	defer cancel(nil)
	if d, ok := ctx.Deadline(); ok {
		var stop context.CancelFunc
		cctx, stop = context.WithDeadline(cctx, d)
		defer stop()
	}
	defer context.AfterFunc(ctx, func() {
		// asynq cancelling the run (a deploy's shutdown, its task lease
		// running out while Redis was unreachable) is no reason to cut a
		// call that has left: it would be in doubt. A cancel of the job
		// through keel is; keel's other reasons come through jc.ended.
		if context.Cause(ctx) == context.Canceled && (g.stopping.Load() || !g.isCancelled(ctx, jc.id)) {
			return
		}
		cancel(context.Cause(ctx))
	})()
	if jc.ended != nil {
		defer context.AfterFunc(jc.ended, func() { cancel(context.Cause(jc.ended)) })()
	}
	return fn(cctx, key)
}

var (
	// ErrNotSent is idempotency.ErrNotSent.
	ErrNotSent = errors.New("not sent")
	// ErrStepAfterComplete is idempotency.ErrStepAfterComplete.
	ErrStepAfterComplete = errors.New("step called after the job's completing InTx")
)

// NotSent is idempotency.NotSent.
func NotSent(err error) error {
	if err == nil {
		return nil
	}
	return fmt.Errorf("%w: %w", ErrNotSent, err)
}

// InDoubt is idempotency.InDoubt.
func InDoubt(err error) error {
	if err == nil {
		return nil
	}
	return fmt.Errorf("%w: %w", ErrInDoubt, err)
}

// callInDoubt reports whether a step whose fn returned err may have taken
// effect. Only a call that never left, or one the other side answered as
// failed, did not.
func callInDoubt(err error) bool {
	switch {
	case errors.Is(err, ErrInDoubt):
		return true
	case errors.Is(err, ErrNotSent):
		return false
	}
	var he *retry.HTTPError
	if errors.As(err, &he) {
		return answerInDoubt(he)
	}
	return true
}

// answerInDoubt reports whether a failed HTTP answer leaves the call in
// doubt. A 4xx is the other side refusing it. A 5xx is not proof of
// anything: the server may have failed after its effect committed, or a
// proxy (502, 504, 520-524) answered for a server that got the request —
// except a 503 with Retry-After, the server saying "not now".
func answerInDoubt(he *retry.HTTPError) bool {
	switch {
	case he.StatusCode < 500:
		return false
	case he.StatusCode == http.StatusServiceUnavailable && he.RetryAfter > 0:
		return false
	}
	return true
}

// inDoubtError is what a step whose call may have happened returns. With a
// Verify the next attempt must happen, since it is where the doubt is
// settled: the error keeps a transient mark (and its Retry-After) or is
// made transient. Without one (or when the client sent the call twice)
// nothing but a person can settle it, so the job is parked at once.
func inDoubtError(jobID, name string, err error, verify bool) error {
	if !verify || errors.Is(err, ErrResent) {
		// Verify can say that a call happened, not that it happened twice.
		// The dead letter must say that a person is needed (and InDoubt's
		// own errors say so already).
		if !wrapsInDoubt(err) {
			return retry.Permanent(fmt.Errorf("keel: step %q of job %s: %w: %w", name, jobID, ErrInDoubt, err))
		}
		return retry.Permanent(fmt.Errorf("keel: step %q of job %s: %w", name, jobID, err))
	}
	d := doubt(fmt.Sprintf("keel: step %q of job %s is in doubt; Verify settles it when the job runs again (its next attempt, or a replay if it dies)", name, jobID), err)
	if e, ok := retry.Marked(err); ok && (e.Class == retry.ClassTransient || e.Class == retry.ClassWait) {
		return d
	}
	return retry.Transient(d)
}

// wrapsInDoubt reports whether ErrInDoubt itself is in err's chain, so
// that its words are in err's message: not only an error that answers
// Is(ErrInDoubt) in its own words (a doubt Verify may settle, a server
// error after the effect).
func wrapsInDoubt(err error) bool {
	if err == ErrInDoubt {
		return true
	}
	switch u := err.(type) {
	case interface{ Unwrap() error }:
		return wrapsInDoubt(u.Unwrap())
	case interface{ Unwrap() []error }:
		for _, e := range u.Unwrap() {
			if wrapsInDoubt(e) {
				return true
			}
		}
	}
	return false
}

// doubt marks err in doubt, like InDoubt, but with msg for its text: a
// doubt Verify may settle does not need a person.
func doubt(msg string, err error) error { return &doubtError{msg: msg, err: err} }

type doubtError struct {
	msg string
	err error
}

func (e *doubtError) Error() string {
	if e.msg == "" {
		return e.err.Error()
	}
	return e.msg + ": " + e.err.Error()
}

func (e *doubtError) Unwrap() error        { return e.err }
func (e *doubtError) Is(target error) bool { return target == ErrInDoubt }

// notVerifiable records that step name of job jobID, in doubt, is one no
// Verify can settle: replayable then waits for a person's word on it.
func notVerifiable(ctx context.Context, pool jobstore.DB, jobID, name string) error {
	err := ledger.StepNotVerifiable(context.WithoutCancel(ctx), pool, jobID, name)
	return interpretError(err)
}
