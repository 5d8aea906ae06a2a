package retry

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/stretchr/testify/require"
)

// run passes err through p's middleware as if asynq had retried the task
// retried times.
func run(p Policy, c *Classifier, kind string, retried int, err error) error {
	count := func(context.Context) (int, bool) { return retried, true }
	h := p.middleware(c, count)(asynq.HandlerFunc(func(context.Context, *asynq.Task) error { return err }))
	return h.ProcessTask(context.Background(), asynq.NewTask(kind, nil))
}

func TestMiddleware(t *testing.T) {
	t.Parallel()

	p := Policy{
		MaxRetry:        5,
		UnknownMaxRetry: 2,
		Overrides:       map[string]Policy{"strict": {UnknownMaxRetry: Disabled}},
	}
	tests := []struct {
		name      string
		kind      string
		retried   int
		err       error
		wantSkip  bool
		wantClass Class
	}{
		{name: "permanent mark", err: Permanent(errBoom), wantSkip: true, wantClass: ClassPermanent},
		{name: "permanent by rule", err: decodeErr(t), wantSkip: true, wantClass: ClassPermanent},
		{name: "unknown within budget", retried: 1, err: errBoom, wantClass: ClassUnknown},
		{name: "unknown at budget", retried: 2, err: errBoom, wantSkip: true, wantClass: ClassUnknown},
		{name: "unknown past budget", retried: 7, err: errBoom, wantSkip: true, wantClass: ClassUnknown},
		{name: "unknown with no budget for kind", kind: "strict", retried: 0, err: errBoom, wantSkip: true, wantClass: ClassUnknown},
		{name: "transient within budget", retried: 4, err: Transient(errBoom), wantClass: ClassTransient},
		{name: "transient by rule", retried: 4, err: canceledErr(t), wantClass: ClassTransient},
		{name: "transient at budget", retried: 5, err: After(time.Minute, errBoom), wantSkip: true, wantClass: ClassTransient},
		{name: "wait never runs out", retried: 1000, err: Wait(0, errBoom), wantClass: ClassWait},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			err := run(p, nil, tt.kind, tt.retried, tt.err)
			require.Error(t, err)
			require.Equal(t, tt.wantSkip, errors.Is(err, asynq.SkipRetry))
			require.Equal(t, tt.err.Error(), err.Error(), "message kept")
			require.ErrorIs(t, err, tt.err, "original kept")
			require.Equal(t, tt.wantClass, Classify(err), "class kept")
			if m, ok := Marked(tt.err); ok {
				got, ok := Marked(err)
				require.True(t, ok)
				require.Same(t, m, got)
			}
		})
	}
}

func TestMiddlewarePassThrough(t *testing.T) {
	t.Parallel()

	require.NoError(t, run(Policy{}, nil, "", 99, nil))

	revoke := fmt.Errorf("order cancelled: %w", asynq.RevokeTask)
	require.Same(t, revoke, run(Policy{}, nil, "", 0, revoke))

	skip := fmt.Errorf("bad: %w", asynq.SkipRetry)
	require.Same(t, skip, run(Policy{}, nil, "", 0, skip))

	wait := Wait(time.Second, errBoom)
	require.Same(t, wait, run(Policy{}, nil, "", 0, wait))
}

func TestMiddlewareRuleWaitIsMarked(t *testing.T) {
	t.Parallel()

	errBusy := errors.New("slot taken")
	c := NewClassifier(func(err error) (Class, bool) { return ClassWait, errors.Is(err, errBusy) })
	err := run(Policy{}, c, "", 50, errBusy)
	require.ErrorIs(t, err, errBusy)
	require.False(t, IsFailure(err), "asynq must not count it")
	require.Equal(t, DefaultWaitDelay, Policy{}.Delay("", 50, err))
}

func TestMiddlewareUsesClassifier(t *testing.T) {
	t.Parallel()

	errFraud := errors.New("fraud suspected")
	c := NewClassifier(func(err error) (Class, bool) { return ClassPermanent, errors.Is(err, errFraud) })
	require.ErrorIs(t, run(Policy{}, c, "", 0, errFraud), asynq.SkipRetry)
	require.NotErrorIs(t, run(Policy{}, NewClassifier(), "", 0, errFraud), asynq.SkipRetry)
}

func TestMiddlewareReadsAsynqRetryCount(t *testing.T) {
	t.Parallel()

	// Outside asynq the context has no retry count: the first attempt.
	h := Policy{}.Middleware(nil)(asynq.HandlerFunc(func(context.Context, *asynq.Task) error { return errBoom }))
	err := h.ProcessTask(t.Context(), asynq.NewTask("x", nil))
	require.ErrorIs(t, err, errBoom)
	require.NotErrorIs(t, err, asynq.SkipRetry)
}

type quotaErr struct{}

func (quotaErr) Error() string { return "quota" }

// The middleware's wrapper for a failure to retry keeps the class a rule
// gave the handler's error, as its wrapper for SkipRetry does: a rule that
// matches the error itself, not through Unwrap, still classes it.
func TestMiddlewareKeepsTheClassOfARetriedError(t *testing.T) {
	t.Parallel()
	c := NewClassifier(func(err error) (Class, bool) {
		if _, ok := err.(quotaErr); ok {
			return ClassTransient, true
		}
		return "", false
	})
	out := run(Policy{}, c, "k", 0, quotaErr{})
	_, decided := DecidedDelay(out)
	require.True(t, decided)
	require.Equal(t, ClassTransient, c.Classify(out))
}
