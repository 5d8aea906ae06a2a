package flow

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/keeljobs/keel/internal/redisconn"
	"github.com/keeljobs/keel/internal/testsignal"
	"github.com/keeljobs/keel/retry"
)

// Errors a postponed job carries inside its retry.Wait, and errors of
// misuse. Match them with errors.Is.
var (
	// ErrNoSlot: every concurrency slot of a rule was taken.
	ErrNoSlot = errors.New("no free concurrency slot")
	// ErrRateLimited: a rule's rate allowed no start yet.
	ErrRateLimited = errors.New("rate limited")
	// ErrUnknownRule: Take or Acquire named a rule the controller does not
	// have, or one without the limit asked for.
	ErrUnknownRule = errors.New("no such flow rule")
)

const (
	// pollInterval is the mean pause between tries for a slot while a job
	// holds: short, because a slot is usually freed by a job finishing, which
	// nobody announces.
	pollInterval = 100 * time.Millisecond
	// releaseTimeout bounds giving a slot back; if it fails the lease
	// returns the slot anyway.
	releaseTimeout = 5 * time.Second
	// releaseRetry is the mean pause between tries to give back a slot
	// whose release failed, until its lease would have freed it.
	releaseRetry = 200 * time.Millisecond
)

// Stats are counters since the controller started.
type Stats struct {
	// Admitted counts jobs the middleware let through to their handler.
	Admitted uint64
	// NoSlot counts postponements for want of a concurrency slot.
	NoSlot uint64
	// RateLimited counts postponements by a rate.
	RateLimited uint64
	// LeasesLost counts slots found gone while their job still ran (Redis
	// was out of reach for longer than the lease).
	LeasesLost uint64
	// RedisErrors counts failed calls to Redis.
	RedisErrors uint64
}

// rule is a Rule with what the controller derives from it.
type rule struct {
	Rule
	slotsKey, rateKey string
	// intervalUS is rounded up, so that rounding never lets a start through
	// early.
	intervalUS, toleranceUS int64
}

// Controller enforces Rules across every worker that shares its Redis. It is
// safe for concurrent use.
type Controller struct {
	cfg    Config
	rdb    redis.UniversalClient
	rules  map[string]*rule
	byKind map[string][]*rule
	holder string
	seq    atomic.Uint64

	stats struct {
		admitted, noSlot, rateLimited, leasesLost, redisErrs atomic.Uint64
	}

	closing   chan struct{}
	renewals  sync.WaitGroup
	closeOnce sync.Once

	signals testSignals
	// renewTicker, when a test sets it (export_test.go), replaces the
	// ticker that paces lease renewals, so the test renews by hand.
	renewTicker func(every time.Duration) <-chan time.Time
}

// testSignals tell tests what the controller did, so they wait on it rather
// than on the clock; off in production (see export_test.go).
type testSignals struct {
	// Busy names the rule of each try that found every slot taken and
	// will try again while the job holds.
	Busy testsignal.Signal[string]
	// Renewed is the outcome of each lease renewal: nil, the Redis error,
	// or errLeaseLost.
	Renewed testsignal.Signal[error]
	// GivenBack names the rule of each slot given back on a retry after a
	// failed release.
	GivenBack testsignal.Signal[string]
}

// errLeaseLost is the Renewed signal of a slot found gone.
var errLeaseLost = errors.New("lease lost")

// New returns a controller enforcing cfg.Rules through cfg.Redis, or the
// error of cfg.Validate. Close it after the worker that uses it has stopped.
func New(cfg Config) (*Controller, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.WithDefaults()
	opt := redisconn.Follow(cfg.Redis)
	rdb, ok := opt.MakeRedisClient().(redis.UniversalClient)
	if !ok {
		return nil, fmt.Errorf("keel: flow: flow.Config.Redis: %T does not make a go-redis client", cfg.Redis)
	}
	c := &Controller{
		cfg:     cfg,
		rdb:     rdb,
		rules:   map[string]*rule{},
		byKind:  map[string][]*rule{},
		holder:  holderName(),
		closing: make(chan struct{}),
	}
	for _, r := range cfg.Rules {
		rr := &rule{Rule: r}
		rr.slotsKey, rr.rateKey = keys(cfg.Prefix, r.Name)
		if r.Rate > 0 {
			perUS := int64(r.Rate) * int64(time.Microsecond)
			rr.intervalUS = int64(r.Period) / perUS
			if int64(r.Period)%perUS != 0 {
				rr.intervalUS++
			}
			rr.toleranceUS = int64(r.Burst-1) * rr.intervalUS
		}
		c.rules[r.Name] = rr
		for _, k := range r.Kinds {
			c.byKind[k] = append(c.byKind[k], rr)
		}
	}
	// One order for everyone, so that two jobs needing the same two slots
	// never each hold one while waiting for the other.
	for _, rs := range c.byKind {
		sort.Slice(rs, func(i, j int) bool { return rs[i].Name < rs[j].Name })
	}
	return c, nil
}

func holderName() string {
	host, _ := os.Hostname()
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	return fmt.Sprintf("%s/%d/%s", host, os.Getpid(), hex.EncodeToString(b))
}

// Close stops renewing leases and closes the Redis connections. Slots still
// held come back when their leases end.
func (c *Controller) Close() error {
	var err error
	c.closeOnce.Do(func() {
		close(c.closing)
		c.renewals.Wait()
		err = c.rdb.Close()
	})
	return err
}

// Stats returns the controller's counters.
func (c *Controller) Stats() Stats {
	return Stats{
		Admitted:    c.stats.admitted.Load(),
		NoSlot:      c.stats.noSlot.Load(),
		RateLimited: c.stats.rateLimited.Load(),
		LeasesLost:  c.stats.leasesLost.Load(),
		RedisErrors: c.stats.redisErrs.Load(),
	}
}

// Middleware admits each job through the rules that name its kind: it takes
// a concurrency slot of each (renewed while the handler runs, given back
// when it returns) and then a start from each rate. A job that cannot start
// within Hold returns a retry.Wait error wrapping ErrNoSlot or
// ErrRateLimited: it is tried again later without using up an attempt. Jobs
// of kinds no rule names pass straight through.
//
// Put it in server.Config.Middleware, where it runs after the ledger claim
// and the retry classifier.
func (c *Controller) Middleware(next asynq.Handler) asynq.Handler {
	return asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
		rules := c.byKind[t.Type()]
		if len(rules) == 0 {
			return next.ProcessTask(ctx, t)
		}
		release, err := c.admit(ctx, rules, c.token(ctx))
		if err != nil {
			return err
		}
		defer release()
		c.stats.admitted.Add(1)
		return next.ProcessTask(ctx, t)
	})
}

// Take waits for a start of the named rule's rate, for limits on a resource
// rather than a kind: call it in a handler right before the call it guards
// ("the mail API: 50/s"). It returns nil once the call may go ahead, having
// waited up to Hold for its turn; otherwise a retry.Wait error wrapping
// ErrRateLimited, for the handler to return, so the job is tried again when
// a start is due without using up an attempt.
//
// As the job starts over when it comes back, put the work done before Take
// in recorded steps (idempotency.Step) or call Take first.
func (c *Controller) Take(ctx context.Context, name string) error {
	r, ok := c.rules[name]
	if !ok || r.Rate == 0 {
		return fmt.Errorf("keel: flow: Take(%q): %w with a Rate", name, ErrUnknownRule)
	}
	wait, err := c.reserve(ctx, r, c.holdUntil(ctx))
	if err != nil {
		return err
	}
	if err := sleep(ctx, wait); err != nil {
		return retry.Wait(c.recheck(), fmt.Errorf("keel: flow: %q: %w: %w", r.Name, ErrRateLimited, err))
	}
	return nil
}

// Acquire takes a concurrency slot of the named rule for a resource used
// inside a handler, waiting up to Hold. Call release when done with the
// resource; until then the slot's lease is renewed. When no slot frees in
// time it returns a retry.Wait error wrapping ErrNoSlot, for the handler to
// return.
func (c *Controller) Acquire(ctx context.Context, name string) (release func(), err error) {
	r, ok := c.rules[name]
	if !ok || r.Concurrency == 0 {
		return nil, fmt.Errorf("keel: flow: Acquire(%q): %w with a Concurrency", name, ErrUnknownRule)
	}
	s, err := c.acquire(ctx, r, c.token(ctx), c.holdUntil(ctx))
	if err != nil {
		return nil, err
	}
	return s.release, nil
}

// token names one admission in the slot sets; the task id tells an operator
// looking at Redis whose slot it is.
func (c *Controller) token(ctx context.Context) string {
	tok := fmt.Sprintf("%s/%d", c.holder, c.seq.Add(1))
	if id, ok := asynq.GetTaskID(ctx); ok {
		tok += "/" + id
	}
	return tok
}

// holdUntil is when a job that cannot start gives up waiting in the worker:
// after Hold, or at its own deadline if that comes first.
func (c *Controller) holdUntil(ctx context.Context) time.Time {
	until := time.Now()
	if c.cfg.Hold > 0 {
		until = until.Add(c.cfg.Hold)
	}
	if d, ok := ctx.Deadline(); ok && d.Before(until) {
		until = d
	}
	return until
}

// admit takes every slot, then every rate start, the rules ask for. Slots
// come first because they can be given back when a rate says no; a rate
// start cannot.
func (c *Controller) admit(ctx context.Context, rules []*rule, token string) (release func(), err error) {
	until := c.holdUntil(ctx)
	var held []*slot
	releaseAll := func() {
		for _, s := range held {
			s.release()
		}
	}
	for _, r := range rules {
		if r.Concurrency == 0 {
			continue
		}
		s, err := c.acquire(ctx, r, token, until)
		if err != nil {
			releaseAll()
			return nil, err
		}
		held = append(held, s)
	}
	var wait time.Duration
	for _, r := range rules {
		if r.Rate == 0 {
			continue
		}
		// A start reserved here and not used (a later rule says no) is lost:
		// the limit is then under-used, never exceeded.
		w, err := c.reserve(ctx, r, until)
		if err != nil {
			releaseAll()
			return nil, err
		}
		wait = max(wait, w)
	}
	if err := sleep(ctx, wait); err != nil {
		releaseAll()
		return nil, retry.Wait(c.recheck(), fmt.Errorf("keel: flow: %w: %w", ErrRateLimited, err))
	}
	return releaseAll, nil
}

// acquire takes a slot of r, trying until until.
func (c *Controller) acquire(ctx context.Context, r *rule, token string, until time.Time) (*slot, error) {
	for {
		ok, err := c.tryAcquire(ctx, r, token)
		switch {
		case err != nil && ctx.Err() != nil:
			return nil, c.noSlot(r, ctx.Err())
		case err != nil:
			return nil, c.redisFailed(r, err)
		case ok:
			return c.hold(r, token), nil
		}
		left := time.Until(until)
		if left <= 0 {
			return nil, c.noSlot(r, nil)
		}
		c.signals.Busy.Signal(r.Name)
		if err := sleep(ctx, min(left, c.jitter(pollInterval))); err != nil {
			return nil, c.noSlot(r, err)
		}
	}
}

// noSlot postpones a job that found every slot of r taken until it gave up
// (because its hold ended, or with cause, its context).
func (c *Controller) noSlot(r *rule, cause error) error {
	c.stats.noSlot.Add(1)
	err := fmt.Errorf("keel: flow: %q: all %d slots taken: %w", r.Name, r.Concurrency, ErrNoSlot)
	if cause != nil {
		err = fmt.Errorf("%w (%w)", err, cause)
	}
	return retry.Wait(c.recheck(), err)
}

// reserve reserves a start of r's rate due before until and returns how long
// to wait for it.
func (c *Controller) reserve(ctx context.Context, r *rule, until time.Time) (time.Duration, error) {
	ok, wait, err := c.tryReserve(ctx, r, max(0, time.Until(until)))
	if err != nil {
		return 0, c.redisFailed(r, err)
	}
	if !ok {
		c.stats.rateLimited.Add(1)
		d := wait + time.Duration(c.cfg.Rand()*float64(c.cfg.Recheck/2))
		return 0, retry.Wait(d, fmt.Errorf("keel: flow: %q: over %d per %v: %w", r.Name, r.Rate, r.Period, ErrRateLimited))
	}
	return wait, nil
}

// redisFailed postpones a job Redis could not admit: the job is not at fault.
func (c *Controller) redisFailed(r *rule, err error) error {
	if !errors.Is(err, context.Canceled) && !errors.Is(err, context.DeadlineExceeded) {
		c.stats.redisErrs.Add(1)
	}
	return retry.Wait(c.recheck(), fmt.Errorf("keel: flow: %q: %w", r.Name, err))
}

// recheck is the delay of a job postponed for want of a slot.
func (c *Controller) recheck() time.Duration { return c.jitter(c.cfg.Recheck) }

// jitter returns a duration in [d/2, 3d/2).
func (c *Controller) jitter(d time.Duration) time.Duration {
	return time.Duration(float64(d) * (0.5 + c.cfg.Rand()))
}

// slot is a held concurrency slot whose lease is renewed until release.
type slot struct {
	c     *Controller
	r     *rule
	token string
	stop  chan struct{}
	done  chan struct{}
	once  sync.Once
	// expires is when the lease ends by this process's clock: from the
	// last acquire or renewal, as the renewer last saw it (read once done
	// is closed).
	expires time.Time
}

// hold starts renewing a slot just taken.
func (c *Controller) hold(r *rule, token string) *slot {
	s := &slot{c: c, r: r, token: token, stop: make(chan struct{}), done: make(chan struct{}),
		expires: time.Now().Add(c.cfg.Lease)}
	c.renewals.Add(1)
	go s.renewLoop()
	return s
}

func (s *slot) renewLoop() {
	defer s.c.renewals.Done()
	defer close(s.done)
	every := s.c.cfg.Lease / 3
	var tick <-chan time.Time
	if s.c.renewTicker != nil {
		tick = s.c.renewTicker(every)
	} else {
		t := time.NewTicker(every)
		defer t.Stop()
		tick = t.C
	}
	for {
		select {
		case <-s.stop:
			return
		case <-s.c.closing:
			return
		case <-tick:
		}
		ctx, cancel := context.WithTimeout(context.Background(), every)
		renewed := time.Now()
		ok, err := s.c.renew(ctx, s.r, s.token)
		cancel()
		switch {
		case err == nil && ok:
			s.expires = renewed.Add(s.c.cfg.Lease)
			s.c.signals.Renewed.Signal(nil)
		case err != nil:
			s.c.stats.redisErrs.Add(1)
			s.c.cfg.Logger.Warn("keel: flow: slot lease renewal failed", "rule", s.r.Name, "token", s.token, "err", err)
			s.c.signals.Renewed.Signal(err)
		case !ok:
			// The slot is gone and the slots are full: its lease ran out
			// (Redis was out of reach) and the slot went to another job, or
			// Redis lost the slots and new jobs took them. The handler runs
			// on regardless.
			s.c.stats.leasesLost.Add(1)
			s.c.cfg.Logger.Warn("keel: flow: slot lease lost while its job runs", "rule", s.r.Name, "token", s.token)
			s.c.signals.Renewed.Signal(errLeaseLost)
			return
		}
	}
}

// release gives the slot back. It is idempotent. When Redis refuses (it is
// failing over, say), the slot is given back in the background as soon as
// Redis answers: a new master holds the slots of every job that ran during
// the failover, which would otherwise stay taken for a whole lease.
func (s *slot) release() {
	s.once.Do(func() {
		close(s.stop)
		<-s.done
		err := s.giveBack(releaseTimeout)
		if err == nil {
			return
		}
		s.c.stats.redisErrs.Add(1)
		select {
		case <-s.c.closing:
		default:
			if time.Now().Before(s.expires) {
				s.c.cfg.Logger.Warn("keel: flow: slot not given back yet; trying again until its lease ends",
					"rule", s.r.Name, "token", s.token, "err", err)
				s.c.renewals.Add(1)
				go s.retryRelease()
				return
			}
		}
		s.c.cfg.Logger.Warn("keel: flow: slot not given back; its lease will free it", "rule", s.r.Name, "token", s.token, "err", err)
	})
}

// retryRelease tries to give the slot back until it is, its lease has run
// out or the controller closes. Removing the slot's own token can never
// free another job's slot, so a late success is harmless.
func (s *slot) retryRelease() {
	defer s.c.renewals.Done()
	for time.Now().Before(s.expires) {
		pause := time.NewTimer(s.c.jitter(releaseRetry))
		select {
		case <-s.c.closing:
			pause.Stop()
			return
		case <-pause.C:
		}
		if s.giveBack(releaseRetry) == nil {
			s.c.cfg.Logger.Info("keel: flow: slot given back", "rule", s.r.Name, "token", s.token)
			s.c.signals.GivenBack.Signal(s.r.Name)
			return
		}
	}
}

func (s *slot) giveBack(timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	return s.c.releaseSlot(ctx, s.r, s.token)
}

// sleep waits d or until ctx ends.
func sleep(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
