package flow

import (
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"strings"
	"time"

	"github.com/hibiken/asynq"
)

// Defaults of Config and Rule.
const (
	// DefaultLease is how long a concurrency slot outlives a worker that
	// stopped renewing it (because it was killed, say).
	DefaultLease = 30 * time.Second
	// DefaultHold is how long a job may wait inside the worker for a slot or
	// a rate token before it is handed back to the queue.
	DefaultHold = time.Second
	// DefaultRecheck is the mean delay of a job postponed for want of a slot.
	DefaultRecheck = 2 * time.Second
	// DefaultPeriod is a rate's time unit.
	DefaultPeriod = time.Second
	// DefaultBurst lets one start through at a time: starts are spaced
	// Period/Rate apart.
	DefaultBurst = 1
	// DefaultPrefix begins every Redis key the controller writes.
	DefaultPrefix = "keel:flow:"
)

// MinLease is the shortest Lease accepted: renewal runs every Lease/3 and
// must not be lost in a Redis round trip.
const MinLease = 100 * time.Millisecond

// NoHold, set in Config.Hold, hands a job that cannot start back to the queue
// at once instead of letting it wait in the worker.
const NoHold time.Duration = -1

// maxNameLen keeps Redis keys and log lines readable.
const maxNameLen = 200

// Rule limits the jobs of some kinds, or the calls to a named resource, across
// every worker that shares the Redis.
type Rule struct {
	// Name identifies the limit: it is part of its Redis keys, so workers
	// configured with the same name share it, and it is what Take and Acquire
	// are called with. Required; up to 200 bytes, without '{' or '}'.
	Name string
	// Kinds are the task kinds (asynq task types) whose jobs the middleware
	// admits through this rule: one kind, or a group sharing one limit. Empty:
	// the rule is used only through Take and Acquire, from inside handlers.
	// A kind may appear in several rules; a job then needs all of them.
	Kinds []string
	// Concurrency is how many may run at once. 0: no concurrency limit.
	Concurrency int
	// Rate is how many may start per Period. 0: no rate limit.
	Rate int
	// Period is the rate's time unit. Default DefaultPeriod (1s).
	Period time.Duration
	// Burst is how many may start back to back after a quiet spell. Default
	// DefaultBurst (1): starts are spaced Period/Rate apart, so no span of one
	// Period holds more than Rate of them; with a larger Burst, up to
	// Rate+Burst-1.
	Burst int
}

// Config configures a Controller.
type Config struct {
	// Redis is where the limits are kept: a single server, Sentinel or
	// Cluster, shared by every worker they apply to. Required.
	Redis asynq.RedisConnOpt
	// Rules are the limits. At least one is required.
	Rules []Rule
	// Lease is how long a concurrency slot is held without renewal. It is
	// renewed every Lease/3 while its job runs, so only a dead worker's slot
	// expires; a shorter lease gives a dead worker's slot back sooner, at
	// the price of more renewals. Default DefaultLease (30s); at least
	// MinLease.
	Lease time.Duration
	// Hold is how long a job may wait inside the worker for its slot or rate
	// token before it is postponed with retry.Wait. asynq moves postponed
	// tasks back to their queue only every few seconds (its
	// DelayedTaskCheckInterval, 5s by default), so a busy limit on short jobs
	// reaches its rate only if jobs can wait here for their turn; a holding
	// job keeps a worker goroutine. Default DefaultHold (1s); NoHold for none.
	// The hold ends early when the job's own deadline comes.
	Hold time.Duration
	// Recheck is the mean delay of a job postponed for want of a concurrency
	// slot; each delay is drawn from [Recheck/2, 3*Recheck/2) so postponed
	// jobs do not all come back at once. A job postponed by a rate limit
	// waits until its token is due, plus up to Recheck/2. Default
	// DefaultRecheck (2s).
	Recheck time.Duration
	// Prefix begins the controller's Redis keys. Default DefaultPrefix
	// ("keel:flow:").
	Prefix string
	// Logger; default slog.Default().
	Logger *slog.Logger
	// Rand returns a number in [0, 1) for the jitter and must be safe for
	// concurrent use. Default: math/rand/v2's Float64.
	Rand func() float64
}

// WithDefaults returns c with each unset field at its default, rules
// included.
func (c Config) WithDefaults() Config {
	if c.Lease == 0 {
		c.Lease = DefaultLease
	}
	if c.Hold == 0 {
		c.Hold = DefaultHold
	}
	if c.Recheck == 0 {
		c.Recheck = DefaultRecheck
	}
	if c.Prefix == "" {
		c.Prefix = DefaultPrefix
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.Rand == nil {
		c.Rand = rand.Float64
	}
	rules := make([]Rule, len(c.Rules))
	for i, r := range c.Rules {
		if r.Rate > 0 && r.Period == 0 {
			r.Period = DefaultPeriod
		}
		if r.Rate > 0 && r.Burst == 0 {
			r.Burst = DefaultBurst
		}
		r.Kinds = append([]string(nil), r.Kinds...)
		rules[i] = r
	}
	c.Rules = rules
	return c
}

// Validate reports everything in c that cannot work.
func (c Config) Validate() error {
	var errs []error
	bad := func(format string, args ...any) {
		errs = append(errs, fmt.Errorf("keel: flow: "+format, args...))
	}
	if c.Redis == nil {
		bad("flow.Config.Redis is required")
	}
	if len(c.Rules) == 0 {
		bad("no rules")
	}
	if c.Lease != 0 && c.Lease < MinLease {
		bad("Lease must be at least %v, got %v", MinLease, c.Lease)
	}
	if c.Hold < NoHold {
		bad("Hold must not be negative (NoHold for none), got %v", c.Hold)
	}
	if c.Recheck < 0 {
		bad("Recheck must not be negative, got %v", c.Recheck)
	}
	if strings.ContainsAny(c.Prefix, "{}") {
		bad("Prefix %q must not contain '{' or '}': the rule's name is the Redis Cluster hash tag", c.Prefix)
	}
	names := map[string]bool{}
	for i, r := range c.Rules {
		errs = append(errs, r.validate(i)...)
		if names[r.Name] && r.Name != "" {
			bad("rule %q is defined twice", r.Name)
		}
		names[r.Name] = true
	}
	return errors.Join(errs...)
}

func (r Rule) validate(i int) []error {
	var errs []error
	label := fmt.Sprintf("rule %d", i)
	if r.Name != "" {
		label = fmt.Sprintf("rule %q", r.Name)
	}
	bad := func(format string, args ...any) {
		errs = append(errs, fmt.Errorf("keel: flow: "+label+": "+format, args...))
	}
	switch {
	case r.Name == "":
		bad("Name is required")
	case len(r.Name) > maxNameLen:
		bad("Name is longer than %d bytes", maxNameLen)
	case strings.ContainsAny(r.Name, "{}"):
		bad("Name must not contain '{' or '}'")
	}
	kinds := map[string]bool{}
	for _, k := range r.Kinds {
		switch {
		case k == "":
			bad("Kinds holds an empty kind")
		case kinds[k]:
			bad("kind %q is listed twice", k)
		}
		kinds[k] = true
	}
	if r.Concurrency < 0 {
		bad("Concurrency must not be negative, got %d", r.Concurrency)
	}
	if r.Rate < 0 {
		bad("Rate must not be negative, got %d", r.Rate)
	}
	if r.Concurrency == 0 && r.Rate == 0 {
		bad("limits nothing: set Concurrency, Rate or both")
	}
	if r.Period < 0 {
		bad("Period must not be negative, got %v", r.Period)
	}
	if r.Burst < 0 {
		bad("Burst must not be negative, got %d", r.Burst)
	}
	if r.Rate == 0 && (r.Period != 0 || r.Burst != 0) {
		bad("Period and Burst need a Rate")
	}
	if r.Rate > 0 {
		period := r.Period
		if period == 0 {
			period = DefaultPeriod
		}
		// Redis keeps time in microseconds; a finer spacing cannot be kept.
		if period/time.Duration(r.Rate) < time.Microsecond {
			bad("Rate %d per %v is more than one per microsecond", r.Rate, period)
		}
	}
	return errs
}
