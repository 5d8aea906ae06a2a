package retry

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/stretchr/testify/require"
)

var errBoom = errors.New("boom")

func TestPolicyBackoff(t *testing.T) {
	t.Parallel()

	p := Policy{Jitter: Disabled}
	tests := []struct {
		retried int
		want    time.Duration
	}{
		{retried: -1, want: 30 * time.Second},
		{retried: 0, want: 30 * time.Second},
		{retried: 1, want: 2 * time.Minute},
		{retried: 2, want: 8 * time.Minute},
		{retried: 3, want: 32 * time.Minute},
		{retried: 4, want: time.Hour},
		{retried: 25, want: time.Hour},
		{retried: math.MaxInt, want: time.Hour},
	}
	for _, tt := range tests {
		require.Equal(t, tt.want, p.Delay("", tt.retried, errBoom), "retried %d", tt.retried)
	}

	small := Policy{Base: 100 * time.Millisecond, Factor: 2, Cap: time.Minute, Jitter: Disabled}
	require.Equal(t, MinDelay, small.Delay("", 0, errBoom), "never below MinDelay")
	require.Equal(t, 1600*time.Millisecond, small.Delay("", 4, errBoom))

	flat := Policy{Base: 10 * time.Second, Factor: 1, Jitter: Disabled}
	require.Equal(t, 10*time.Second, flat.Delay("", 7, errBoom))
}

func TestPolicyJitter(t *testing.T) {
	t.Parallel()

	p := Policy{Rand: SeededRand(42)}
	exact := Policy{Jitter: Disabled}
	for retried := range 8 {
		d := exact.Delay("", retried, errBoom)
		lo, hi := time.Duration(float64(d)*0.8), time.Duration(float64(d)*1.2)
		least, most := time.Duration(math.MaxInt64), time.Duration(0)
		for range 1000 {
			got := p.Delay("", retried, errBoom)
			least, most = min(least, got), max(most, got)
		}
		require.GreaterOrEqual(t, least, lo, "retried %d", retried)
		require.LessOrEqual(t, most, hi, "retried %d", retried)
		require.NotEqual(t, least, most, "retried %d: jitter spreads", retried)
	}
}

func TestPolicyJitterDistribution(t *testing.T) {
	t.Parallel()

	const n = 10_000
	want := 2 * time.Minute // retried 1, before jitter
	p := Policy{Rand: SeededRand(7)}
	var sum float64
	var below, above, nearLow, nearHigh int
	for range n {
		d := p.Delay("", 1, errBoom)
		sum += float64(d)
		switch {
		case d < want:
			below++
		case d > want:
			above++
		}
		if d < time.Duration(float64(want)*0.81) {
			nearLow++
		}
		if d > time.Duration(float64(want)*1.19) {
			nearHigh++
		}
	}
	// The factor is uniform on [0.8, 1.2]: mean 1, and the standard error of
	// the mean of 10,000 draws is about 0.1%, so 2% cannot fail by chance.
	mean := sum / n
	require.InEpsilon(t, float64(want), mean, 0.02)
	require.Greater(t, below, n*4/10)
	require.Greater(t, above, n*4/10)
	// Each outer 2.5% of the range should hold about 250 draws.
	require.Greater(t, nearLow, 100)
	require.Greater(t, nearHigh, 100)
}

func TestPolicySeededIsDeterministic(t *testing.T) {
	t.Parallel()

	a, b := Policy{Rand: SeededRand(3)}, Policy{Rand: SeededRand(3)}
	for retried := range 20 {
		require.Equal(t, a.Delay("", retried, errBoom), b.Delay("", retried, errBoom))
	}
}

func TestPolicyConcurrentDelay(t *testing.T) {
	t.Parallel()

	p := Policy{Rand: SeededRand(1), Overrides: map[string]Policy{"mail": {Base: time.Minute}}}
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for i := range 500 {
				_ = p.Delay("mail", i%10, errBoom)
				_ = p.Budget("mail", ClassTransient)
			}
		})
	}
	wg.Wait()
}

func TestPolicyAskedDelay(t *testing.T) {
	t.Parallel()

	p := Policy{Rand: SeededRand(1)}
	tests := []struct {
		name    string
		retried int
		err     error
		want    time.Duration
	}{
		{name: "after", retried: 5, err: After(2*time.Minute, errBoom), want: 2 * time.Minute},
		{name: "after beyond Cap", retried: 0, err: After(3*time.Hour, errBoom), want: 3 * time.Hour},
		{name: "after beyond AfterCap", retried: 0, err: After(48*time.Hour, errBoom), want: DefaultAfterCap},
		{name: "after below MinDelay", retried: 0, err: After(time.Millisecond, errBoom), want: MinDelay},
		{name: "wrapped after", retried: 0, err: fmt.Errorf("charge: %w", After(time.Minute, errBoom)), want: time.Minute},
		{name: "wait with delay", retried: 3, err: Wait(10*time.Second, errBoom), want: 10 * time.Second},
		{name: "wait without delay", retried: 3, err: Wait(0, errBoom), want: DefaultWaitDelay},
		{name: "retry-after from a response", retried: 0, err: After(90*time.Second, &HTTPError{StatusCode: 429}), want: 90 * time.Second},
	}
	for _, tt := range tests {
		require.Equal(t, tt.want, p.Delay("", tt.retried, tt.err), tt.name)
	}

	// A transient mark without a delay backs off like any error.
	exact := Policy{Jitter: Disabled}
	require.Equal(t, 8*time.Minute, exact.Delay("", 2, Transient(errBoom)))
	require.Equal(t, 8*time.Minute, exact.Delay("", 2, After(-time.Second, errBoom)))
}

func TestPolicyOverrides(t *testing.T) {
	t.Parallel()

	p := Policy{
		Factor:    2,
		Jitter:    Disabled,
		WaitDelay: 20 * time.Second,
		Overrides: map[string]Policy{
			"mail:send": {Base: time.Minute, MaxRetry: 2, UnknownMaxRetry: Disabled},
			"report":    {Cap: 10 * time.Minute, Jitter: 0.5},
		},
	}
	require.Equal(t, 2*time.Minute, p.Delay("mail:send", 1, errBoom), "Base overridden, Factor from the policy")
	require.Equal(t, 20*time.Second, p.Delay("mail:send", 1, Wait(0, errBoom)), "WaitDelay from the policy")
	require.Equal(t, 60*time.Second, p.Delay("other", 1, errBoom))
	require.Equal(t, 2, p.Budget("mail:send", ClassTransient))
	require.Equal(t, 0, p.Budget("mail:send", ClassUnknown))
	require.Equal(t, DefaultMaxRetry, p.Budget("other", ClassTransient))

	for range 100 {
		d := p.Delay("report", 10, errBoom)
		require.GreaterOrEqual(t, d, 5*time.Minute)
		require.LessOrEqual(t, d, 15*time.Minute)
	}
}

func TestPolicyBudget(t *testing.T) {
	t.Parallel()

	tests := []struct {
		name   string
		policy Policy
		class  Class
		want   int
	}{
		{name: "transient default", class: ClassTransient, want: DefaultMaxRetry},
		{name: "unknown default", class: ClassUnknown, want: DefaultUnknownMaxRetry},
		{name: "empty class is unknown", class: "", want: DefaultUnknownMaxRetry},
		{name: "permanent", class: ClassPermanent, want: 0},
		{name: "wait has none", class: ClassWait, want: math.MaxInt},
		{name: "transient set", policy: Policy{MaxRetry: 25}, class: ClassTransient, want: 25},
		{name: "transient disabled", policy: Policy{MaxRetry: Disabled}, class: ClassTransient, want: 0},
		{name: "unknown disabled", policy: Policy{UnknownMaxRetry: Disabled}, class: ClassUnknown, want: 0},
	}
	for _, tt := range tests {
		require.Equal(t, tt.want, tt.policy.Budget("", tt.class), tt.name)
	}
}

func TestRetryDelayFunc(t *testing.T) {
	t.Parallel()

	p := Policy{Jitter: Disabled, Overrides: map[string]Policy{"mail:send": {Base: time.Minute}}}
	f := p.RetryDelayFunc()
	require.Equal(t, 4*time.Minute, f(1, errBoom, asynq.NewTask("mail:send", nil)))
	require.Equal(t, 2*time.Minute, f(1, errBoom, asynq.NewTask("order:ship", nil)))
	require.Equal(t, 30*time.Second, f(0, errBoom, nil))
	require.Equal(t, DefaultWaitDelay, f(9, Wait(0, errBoom), asynq.NewTask("order:ship", nil)))
}

func TestIsFailure(t *testing.T) {
	t.Parallel()

	require.False(t, IsFailure(Wait(time.Second, errBoom)))
	require.False(t, IsFailure(fmt.Errorf("lease held: %w", Wait(0, nil))))
	require.True(t, IsFailure(errBoom))
	require.True(t, IsFailure(Transient(errBoom)))
	require.True(t, IsFailure(Permanent(errBoom)))
	// Runs asynq cut short itself are released uncharged by keel's ledger.
	require.False(t, IsFailure(context.Canceled))
	require.False(t, IsFailure(asynq.ErrLeaseExpired))
	require.True(t, IsFailure(context.DeadlineExceeded))
}

func TestPolicyValidate(t *testing.T) {
	t.Parallel()

	valid := []Policy{
		{},
		Policy{}.WithDefaults(),
		{Jitter: Disabled, MaxRetry: Disabled, UnknownMaxRetry: Disabled},
		{Jitter: 1, Factor: 1, Base: time.Hour, Cap: time.Hour},
		{Overrides: map[string]Policy{"mail": {Base: time.Minute, Cap: 2 * time.Hour}}},
	}
	for _, p := range valid {
		require.NoError(t, p.Validate(), "%+v", p)
	}

	tests := []struct {
		name    string
		policy  Policy
		wantErr string
	}{
		{name: "negative base", policy: Policy{Base: -time.Second}, wantErr: "Base must not be negative"},
		{name: "negative cap", policy: Policy{Cap: -time.Second}, wantErr: "Cap must not be negative"},
		{name: "negative wait", policy: Policy{WaitDelay: -time.Second}, wantErr: "WaitDelay must not be negative"},
		{name: "negative after cap", policy: Policy{AfterCap: -time.Second}, wantErr: "AfterCap must not be negative"},
		{name: "factor below 1", policy: Policy{Factor: 0.5}, wantErr: "Factor must be at least 1, got 0.5"},
		{name: "factor NaN", policy: Policy{Factor: math.NaN()}, wantErr: "Factor must be at least 1"},
		{name: "jitter above 1", policy: Policy{Jitter: 1.5}, wantErr: "Jitter must be within [0, 1]"},
		{name: "jitter negative", policy: Policy{Jitter: -0.5}, wantErr: "Jitter must be within [0, 1]"},
		{name: "max retry negative", policy: Policy{MaxRetry: -2}, wantErr: "MaxRetry must not be negative"},
		{name: "unknown max retry negative", policy: Policy{UnknownMaxRetry: -3}, wantErr: "UnknownMaxRetry must not be negative"},
		{name: "cap below base", policy: Policy{Base: time.Minute, Cap: time.Second}, wantErr: "Cap (1s) is less than Base (1m0s)"},
		{name: "cap below default base", policy: Policy{Cap: 10 * time.Second}, wantErr: "Cap (10s) is less than Base (30s)"},
		{
			name:    "override field",
			policy:  Policy{Overrides: map[string]Policy{"mail": {Factor: 0.1}}},
			wantErr: `Overrides["mail"].Factor must be at least 1`,
		},
		{
			name:    "override merged cap below base",
			policy:  Policy{Overrides: map[string]Policy{"mail": {Base: 2 * time.Hour}}},
			wantErr: `Overrides["mail"].Cap (1h0m0s) is less than Base (2h0m0s)`,
		},
		{
			name:    "nested overrides",
			policy:  Policy{Overrides: map[string]Policy{"mail": {Overrides: map[string]Policy{"x": {}}}}},
			wantErr: `Overrides["mail"].Overrides must be empty`,
		},
	}
	for _, tt := range tests {
		err := tt.policy.Validate()
		require.ErrorContains(t, err, tt.wantErr, tt.name)
		require.ErrorContains(t, err, "retry: ", tt.name)
	}

	err := Policy{Base: -1, Jitter: 2}.Validate()
	require.ErrorContains(t, err, "Base")
	require.ErrorContains(t, err, "Jitter", "every problem is reported")
}

func TestWithDefaults(t *testing.T) {
	t.Parallel()

	p := Policy{Base: time.Minute, Jitter: Disabled}.WithDefaults()
	require.Equal(t, time.Minute, p.Base)
	require.Equal(t, DefaultFactor, p.Factor)
	require.Equal(t, DefaultCap, p.Cap)
	require.Equal(t, float64(Disabled), p.Jitter)
	require.Equal(t, DefaultMaxRetry, p.MaxRetry)
	require.Equal(t, DefaultUnknownMaxRetry, p.UnknownMaxRetry)
	require.Equal(t, DefaultWaitDelay, p.WaitDelay)
	require.Equal(t, DefaultAfterCap, p.AfterCap)
	require.NotNil(t, p.Rand)
}
