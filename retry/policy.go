package retry

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/hibiken/asynq"
)

// Defaults of Policy's fields.
const (
	DefaultBase            = 30 * time.Second
	DefaultFactor          = 4.0
	DefaultCap             = time.Hour
	DefaultJitter          = 0.2
	DefaultMaxRetry        = 10
	DefaultUnknownMaxRetry = 3
	DefaultWaitDelay       = 5 * time.Second
	DefaultAfterCap        = 24 * time.Hour
)

// MinDelay is the shortest delay Policy returns: a failed job never re-runs
// at once. It is also asynq's resolution, which schedules in whole seconds.
const MinDelay = time.Second

// Disabled, set in Policy.Jitter, MaxRetry or UnknownMaxRetry, turns that
// setting off where a zero would mean its default.
const Disabled = -1

// Policy decides how long a failed job waits and how many failures of each
// class it may have. The zero value is ready to use: a zero field takes its
// default. A Policy is safe for concurrent use as long as it is not modified.
type Policy struct {
	// Base is the delay after the first failure. Default DefaultBase (30s).
	Base time.Duration
	// Factor multiplies the delay after each further failure. Default
	// DefaultFactor (4): 30s, 2m, 8m, 32m, then Cap.
	Factor float64
	// Cap bounds the backoff before jitter is applied, so that jobs at the
	// cap still spread out. Default DefaultCap (1h).
	Cap time.Duration
	// Jitter spreads delays: the backoff is multiplied by a uniform random
	// factor in [1-Jitter, 1+Jitter], which keeps its mean. Default
	// DefaultJitter (0.2); Disabled for none.
	Jitter float64
	// MaxRetry is how many times a transient failure is retried. Default
	// DefaultMaxRetry (10); Disabled for none. The task's own MaxRetry, set at
	// enqueue, remains the hard cap for every class: asynq archives a task
	// whose retries reach it, whatever the error.
	MaxRetry int
	// UnknownMaxRetry is how many times an unclassified failure is retried.
	// Default DefaultUnknownMaxRetry (3); Disabled for none.
	UnknownMaxRetry int
	// WaitDelay is the delay of a Wait made without one. Default
	// DefaultWaitDelay (5s).
	WaitDelay time.Duration
	// AfterCap bounds a delay that the error itself asks for (After, Wait,
	// an HTTP Retry-After). Such a delay is honoured even beyond Cap: the
	// other side knows when it will be ready. Default DefaultAfterCap (24h).
	AfterCap time.Duration
	// Overrides holds per-kind policies (the key is the asynq task type). A
	// zero field of an override takes the value of this policy; an
	// override's own Overrides and Rand are not used.
	Overrides map[string]Policy
	// Rand returns a number in [0, 1) for the jitter and must be safe for
	// concurrent use. Default: math/rand/v2's Float64. SeededRand gives a
	// reproducible one.
	Rand func() float64
}

// SeededRand returns a deterministic source for Policy.Rand, safe for
// concurrent use.
func SeededRand(seed uint64) func() float64 {
	var mu sync.Mutex
	r := rand.New(rand.NewPCG(seed, seed))
	return func() float64 {
		mu.Lock()
		defer mu.Unlock()
		return r.Float64()
	}
}

// WithDefaults returns p with each zero field set to its default. Overrides
// are merged when used, not here.
func (p Policy) WithDefaults() Policy {
	if p.Base == 0 {
		p.Base = DefaultBase
	}
	if p.Factor == 0 {
		p.Factor = DefaultFactor
	}
	if p.Cap == 0 {
		p.Cap = DefaultCap
	}
	if p.Jitter == 0 {
		p.Jitter = DefaultJitter
	}
	if p.MaxRetry == 0 {
		p.MaxRetry = DefaultMaxRetry
	}
	if p.UnknownMaxRetry == 0 {
		p.UnknownMaxRetry = DefaultUnknownMaxRetry
	}
	if p.WaitDelay == 0 {
		p.WaitDelay = DefaultWaitDelay
	}
	if p.AfterCap == 0 {
		p.AfterCap = DefaultAfterCap
	}
	if p.Rand == nil {
		p.Rand = rand.Float64
	}
	return p
}

// Validate reports every setting that cannot work, in p and in each
// override as merged with p.
func (p Policy) Validate() error {
	errs := p.validate("")
	base := p.WithDefaults()
	for kind, o := range p.Overrides {
		prefix := fmt.Sprintf("Overrides[%q].", kind)
		errs = append(errs, o.validate(prefix)...)
		if len(o.Overrides) > 0 {
			errs = append(errs, fmt.Errorf("retry: %sOverrides must be empty: overrides do not nest", prefix))
		}
		if m := merge(base, o); m.Cap < m.Base {
			errs = append(errs, fmt.Errorf("retry: %sCap (%v) is less than Base (%v)", prefix, m.Cap, m.Base))
		}
	}
	return errors.Join(errs...)
}

func (p Policy) validate(prefix string) []error {
	var errs []error
	bad := func(format string, args ...any) {
		errs = append(errs, fmt.Errorf("retry: "+prefix+format, args...))
	}
	for _, f := range []struct {
		name string
		d    time.Duration
	}{{"Base", p.Base}, {"Cap", p.Cap}, {"WaitDelay", p.WaitDelay}, {"AfterCap", p.AfterCap}} {
		if f.d < 0 {
			bad("%s must not be negative, got %v", f.name, f.d)
		}
	}
	if p.Factor != 0 && !(p.Factor >= 1) { // also catches NaN
		bad("Factor must be at least 1, got %v", p.Factor)
	}
	if p.Jitter != Disabled && !(p.Jitter >= 0 && p.Jitter <= 1) {
		bad("Jitter must be within [0, 1] (or Disabled), got %v", p.Jitter)
	}
	if p.MaxRetry < Disabled {
		bad("MaxRetry must not be negative (Disabled for none), got %d", p.MaxRetry)
	}
	if p.UnknownMaxRetry < Disabled {
		bad("UnknownMaxRetry must not be negative (Disabled for none), got %d", p.UnknownMaxRetry)
	}
	if prefix == "" {
		if d := p.WithDefaults(); d.Cap < d.Base {
			bad("Cap (%v) is less than Base (%v)", d.Cap, d.Base)
		}
	}
	return errs
}

// merge fills p's zero fields from base, which already has its defaults.
func merge(base, p Policy) Policy {
	if p.Base == 0 {
		p.Base = base.Base
	}
	if p.Factor == 0 {
		p.Factor = base.Factor
	}
	if p.Cap == 0 {
		p.Cap = base.Cap
	}
	if p.Jitter == 0 {
		p.Jitter = base.Jitter
	}
	if p.MaxRetry == 0 {
		p.MaxRetry = base.MaxRetry
	}
	if p.UnknownMaxRetry == 0 {
		p.UnknownMaxRetry = base.UnknownMaxRetry
	}
	if p.WaitDelay == 0 {
		p.WaitDelay = base.WaitDelay
	}
	if p.AfterCap == 0 {
		p.AfterCap = base.AfterCap
	}
	p.Rand = base.Rand
	p.Overrides = nil
	return p
}

// forKind returns the complete policy for one kind of task.
func (p Policy) forKind(kind string) Policy {
	base := p.WithDefaults()
	if o, ok := p.Overrides[kind]; ok {
		return merge(base, o)
	}
	return base
}

// Delay returns how long a task of kind waits after its attempt failed with
// err, when it has been retried retried times before. A delay the error asks
// for (After, Wait) is used as is, up to AfterCap; a Wait without one waits
// WaitDelay; anything else backs off exponentially from Base, capped at Cap
// and jittered. The result is never below MinDelay.
func (p Policy) Delay(kind string, retried int, err error) time.Duration {
	p = p.forKind(kind)
	if e, ok := Marked(err); ok {
		switch {
		case e.Delay > 0:
			return max(MinDelay, min(e.Delay, p.AfterCap))
		case e.Class == ClassWait:
			return max(MinDelay, p.WaitDelay)
		}
	}
	return p.backoff(retried)
}

func (p Policy) backoff(retried int) time.Duration {
	// Floats, because Factor^retried overflows a Duration long before the
	// retry count is unreasonable; Inf compares above Cap like any large value.
	d := float64(p.Base) * math.Pow(p.Factor, float64(max(retried, 0)))
	if !(d <= float64(p.Cap)) {
		d = float64(p.Cap)
	}
	if p.Jitter > 0 {
		d *= 1 - p.Jitter + 2*p.Jitter*p.Rand()
	}
	if d >= math.MaxInt64 {
		return math.MaxInt64
	}
	return max(MinDelay, time.Duration(d))
}

// Budget returns how many retries a task of kind gets for failures of class:
// none for permanent, MaxRetry for transient, UnknownMaxRetry for unknown
// (and for an empty class). A wait is not a failure and has no budget
// (math.MaxInt): the code that returns Wait decides when to give up.
func (p Policy) Budget(kind string, class Class) int {
	p = p.forKind(kind)
	switch class {
	case ClassPermanent:
		return 0
	case ClassTransient:
		return max(0, p.MaxRetry)
	case ClassWait:
		return math.MaxInt
	default:
		return max(0, p.UnknownMaxRetry)
	}
}

// RetryDelayFunc adapts Delay for asynq.Config.RetryDelayFunc; the kind is
// the task's type. A delay Middleware decided (DecidedDelay) is returned as
// is, so that the retry happens when the ledger says it does.
func (p Policy) RetryDelayFunc() asynq.RetryDelayFunc {
	return func(n int, err error, t *asynq.Task) time.Duration {
		if d, ok := DecidedDelay(err); ok {
			return d
		}
		var kind string
		if t != nil {
			kind = t.Type()
		}
		return p.Delay(kind, n, err)
	}
}

// IsFailure is for asynq.Config.IsFailure: what asynq counts towards its
// retry limit. A Wait does not use up an attempt, and neither does a run
// asynq itself cut short — cancelled (a deploy's shutdown,
// Inspector.CancelProcessing) or its task lease lost while Redis was
// unreachable: keel's ledger releases such runs uncharged, and asynq's
// count must not retire a job the ledger's budget would still run.
func IsFailure(err error) bool {
	return !IsWait(err) && !errors.Is(err, context.Canceled) && !errors.Is(err, asynq.ErrLeaseExpired)
}
