package retry

import (
	"context"
	"errors"
	"time"

	"github.com/hibiken/asynq"
)

// Middleware is the one place where keel's failure classes become asynq's
// behaviour. It classifies the handler's error with c (Default when nil):
//   - permanent: wraps it with asynq.SkipRetry, so the task is archived now;
//   - transient or unknown: returns it for asynq to retry, unless the task's
//     retries have reached the class's Budget, when it wraps it with
//     asynq.SkipRetry as well;
//   - wait: returns it marked with Wait, so that IsFailure and Delay see it.
//
// A wrapped error keeps the original's message and chain (errors.As still
// finds a *Error), and Classify still returns the original class. Errors
// that already carry asynq.SkipRetry or asynq.RevokeTask pass unchanged.
//
// Place it inside any middleware that records outcomes, so that they see
// the translated error. The task's MaxRetry, set at enqueue, still caps the
// retries of every class.
func (p Policy) Middleware(c *Classifier) func(asynq.Handler) asynq.Handler {
	return p.middleware(c, retriedSoFar)
}

type retriedKey struct{}

// WithRetried records how many counted attempts a job has failed before this
// one. keel's ledger sets it: asynq's own count starts again at zero when a
// job is published anew (a replay, a republish after Redis lost data), and a
// budget read from it would never run out.
func WithRetried(ctx context.Context, n int) context.Context {
	return context.WithValue(ctx, retriedKey{}, n)
}

// retriedSoFar prefers the ledger's count, then asynq's.
func retriedSoFar(ctx context.Context) (int, bool) {
	if n, ok := ctx.Value(retriedKey{}).(int); ok {
		return n, true
	}
	return asynq.GetRetryCount(ctx)
}

// middleware takes the retry count as a function because asynq sets it in
// the context with keys only its internals can reach.
func (p Policy) middleware(c *Classifier, retryCount func(context.Context) (int, bool)) func(asynq.Handler) asynq.Handler {
	if c == nil {
		c = Default
	}
	return func(next asynq.Handler) asynq.Handler {
		return asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
			err := next.ProcessTask(ctx, t)
			if err == nil || errors.Is(err, asynq.SkipRetry) || errors.Is(err, asynq.RevokeTask) {
				return err
			}
			class := c.Classify(err)
			if class == ClassWait {
				if IsWait(err) {
					return err
				}
				return Wait(0, err)
			}
			retried, _ := retryCount(ctx)
			if class == ClassPermanent || retried >= p.Budget(t.Type(), class) {
				return &skipRetry{err: err, class: class}
			}
			// Decided once, here: the ledger records the retry's time
			// (DecidedDelay) and asynq schedules it (RetryDelayFunc).
			return &decided{err: err, class: class, delay: p.Delay(t.Type(), retried, err)}
		})
	}
}

// decided is a failure to retry after delay, as the middleware chose it.
type decided struct {
	err   error
	class Class
	delay time.Duration
}

func (e *decided) Error() string { return e.err.Error() }

func (e *decided) Unwrap() error { return e.err }

// DecidedDelay is the delay Middleware chose for a failure it passed on to
// be retried: what asynq waits (RetryDelayFunc returns it as is) and what
// keel's ledger records as the job's next run. ok is false for any other
// error.
func DecidedDelay(err error) (d time.Duration, ok bool) {
	var e *decided
	if errors.As(err, &e) {
		return e.delay, true
	}
	return 0, false
}

// skipRetry is a failure that asynq must not retry.
type skipRetry struct {
	err   error
	class Class
}

func (e *skipRetry) Error() string { return e.err.Error() }

func (e *skipRetry) Unwrap() []error { return []error{e.err, asynq.SkipRetry} }
