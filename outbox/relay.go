package outbox

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/trace"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/jobstore"
	"github.com/keeljobs/keel/internal/ledger"
	"github.com/keeljobs/keel/internal/redisconn"
	"github.com/keeljobs/keel/internal/testsignal"
)

// Defaults of RelayConfig.
const (
	DefaultPollInterval = time.Second
	DefaultBatchSize    = 200
	DefaultAwakePoll    = 2 * time.Millisecond
	DefaultIdleAfter    = 500 * time.Millisecond
)

// RelayConfig configures a Relay.
type RelayConfig struct {
	// Pool holds the ledger. Required.
	Pool *pgxpool.Pool
	// Redis is where jobs are published. Required.
	Redis asynq.RedisConnOpt
	// PollInterval is how often a sleeping relay looks for unpublished rows
	// when no notification wakes it. Default: DefaultPollInterval (1s).
	PollInterval time.Duration
	// AwakePoll is how often the awake relay looks for new rows. Writers do
	// not notify an awake relay, so a job committed meanwhile waits up to
	// this long. Default: DefaultAwakePoll (2ms).
	AwakePoll time.Duration
	// IdleAfter is how long the awake relay polls without finding a row
	// before it goes back to sleep (and writers notify again). Default:
	// DefaultIdleAfter (500ms).
	IdleAfter time.Duration
	// BatchSize is how many rows one pass claims. Default: DefaultBatchSize
	// (200).
	BatchSize int
	// Logger; default slog.Default().
	Logger *slog.Logger
	// TracerProvider records a keel.publish span for each job it publishes
	// that was enqueued in a trace, a child of the enqueue's span (the
	// trace context comes from the job's row). Default: the global provider
	// (otel.GetTracerProvider); while that is the no-op, no span is started.
	TracerProvider trace.TracerProvider
}

// Validate reports everything in c that cannot work.
func (c RelayConfig) Validate() error {
	var errs []error
	if c.Pool == nil {
		errs = append(errs, errors.New("keel: outbox.RelayConfig.Pool is required"))
	}
	if c.Redis == nil {
		errs = append(errs, errors.New("keel: outbox.RelayConfig.Redis is required"))
	}
	errs = append(errs, notNegative("RelayConfig.PollInterval", c.PollInterval),
		notNegative("RelayConfig.AwakePoll", c.AwakePoll),
		notNegative("RelayConfig.IdleAfter", c.IdleAfter),
		notNegative("RelayConfig.BatchSize", c.BatchSize))
	return errors.Join(errs...)
}

// notNegative refuses a negative setting; zero stands for its default.
func notNegative[N time.Duration | int](field string, v N) error {
	if v < 0 {
		return fmt.Errorf("keel: outbox.%s must not be negative (0 for its default), got %v", field, v)
	}
	return nil
}

// WithDefaults returns c with each unset field at its default.
func (c RelayConfig) WithDefaults() RelayConfig {
	if c.PollInterval == 0 {
		c.PollInterval = DefaultPollInterval
	}
	if c.AwakePoll == 0 {
		c.AwakePoll = DefaultAwakePoll
	}
	if c.IdleAfter == 0 {
		c.IdleAfter = DefaultIdleAfter
	}
	if c.BatchSize == 0 {
		c.BatchSize = DefaultBatchSize
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

// Relay publishes ledger rows that are committed but not yet in Redis:
// written by EnqueueTx, by Enqueue while Redis was down, or handed back by
// a worker. Any number of relays can run at once: rows are claimed with
// FOR UPDATE SKIP LOCKED, and the ledger id is the asynq task id, so a
// publish repeated after a crash is a harmless conflict.
//
// A relay sleeps until a writer's notification (or its poll) finds rows;
// then one relay stays awake, polling every AwakePoll while rows keep
// coming, and writers skip the notification that would serialise their
// commits (ledger.RelayAwakeLock tells how).
type Relay struct {
	pool  *pgxpool.Pool
	store *jobstore.Store
	pub   *jobstore.Publisher
	cfg   RelayConfig

	published atomic.Uint64
	listening atomic.Bool

	signals relaySignals
	// clock, set by tests only (export_test.go), is what the relay judges
	// its idleness by; nil is the wall clock.
	clock func() time.Time
}

// now is the time by the relay's clock.
func (r *Relay) now() time.Time {
	if r.clock != nil {
		return r.clock()
	}
	return time.Now()
}

// relaySignals tell tests what Run did, so they wait on it rather than on
// the clock; off in production (see export_test.go).
type relaySignals struct {
	// Listening is sent each time the relay starts listening for writers'
	// notifications.
	Listening testsignal.Signal[struct{}]
	// Passed is each look of Run at the ledger that published or failed,
	// changed the relay's state or found it still waiting to settle, once
	// the state follows from what it found. The looks of an awake relay
	// that found nothing, every AwakePoll, are not sent.
	Passed testsignal.Signal[relayPass]
}

// relayPass is one look of Run, as relaySignals report it.
type relayPass struct {
	// Published is how many jobs the look published.
	Published int
	Err       error
	// State is the relay's state after the look: asleep, it waits for a
	// notification or its poll.
	State relayState
}

// NewRelay returns a relay; Run it, then Close it. It fails when
// cfg.Validate does.
func NewRelay(cfg RelayConfig) (*Relay, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	pool, redis := cfg.Pool, cfg.Redis
	return &Relay{pool: pool, store: jobstore.NewStore(pool).WithTracerProvider(cfg.TracerProvider), pub: jobstore.NewPublisher(redisconn.Follow(redis)), cfg: cfg.WithDefaults()}, nil
}

// Close releases the relay's Redis connections.
func (r *Relay) Close() error { return r.pub.Close() }

// Published is how many jobs this relay has published.
func (r *Relay) Published() uint64 { return r.published.Load() }

// Listening tells whether the relay is listening for writers'
// notifications: a running relay is, but for a moment at start and after a
// lost connection, when a commit waits for its next poll instead. A
// readiness check can wait for it.
func (r *Relay) Listening() bool { return r.listening.Load() }

// The states of a running relay.
type relayState int

const (
	asleep   relayState = iota // listening; writers notify
	awake                      // holds the awake lock; writers do not notify
	settling                   // let go of it; waits for the writers that did not notify
)

// Run publishes until ctx ends. A sleeping relay wakes on the ledger's
// notification and polls as a fallback, so a lost notification delays a
// job by at most one poll interval.
func (r *Relay) Run(ctx context.Context) error {
	wake := make(chan struct{}, 1)
	var wg sync.WaitGroup
	defer wg.Wait()
	wg.Go(func() { r.listen(ctx, wake) })
	locks := &relayLocks{pool: r.pool}
	defer locks.close()

	tick := time.NewTicker(r.cfg.PollInterval)
	defer tick.Stop()
	poll := time.NewTimer(0)
	defer poll.Stop()
	state := asleep
	var lastWork, lastLegacy time.Time
	for {
		legacy := state != awake || time.Since(lastLegacy) >= legacyPoll
		if legacy {
			lastLegacy = time.Now()
		}
		n, err := r.drain(ctx, legacy)
		if ctx.Err() != nil {
			return nil
		}
		if n > 0 {
			lastWork = r.now()
		}
		was := state
		switch {
		case err != nil:
			// The ledger or Redis is failing: no point polling fast.
			r.cfg.Logger.Warn("keel relay: publish pass failed", "err", err)
		case state == asleep && n > 0, state == settling && n > 0:
			state = r.wakeUp(ctx, locks)
		case state == awake && r.now().Sub(lastWork) >= r.cfg.IdleAfter:
			if err := locks.unlock(ctx, ledger.RelayAwakeLock); err != nil {
				locks.close() // lets go of every lock
			}
			state = settling
		case state == settling:
			var settled int
			state, settled = r.settle(ctx, locks)
			n += settled
		}
		if r.signals.Passed.On() && (n > 0 || err != nil || state != was || state == settling) {
			r.signals.Passed.Signal(relayPass{Published: n, Err: err, State: state})
		}
		if state == asleep || err != nil {
			select {
			case <-ctx.Done():
				return nil
			case <-wake:
			case <-tick.C:
			}
			continue
		}
		poll.Reset(r.cfg.AwakePoll)
		select {
		case <-ctx.Done():
			return nil
		case <-wake:
			// A writer that notifies an awake relay wrote unpublished
			// rows (a replay, a batch's callback, an older binary).
			lastLegacy = time.Time{}
		case <-poll.C:
		}
	}
}

// legacyPoll is how often the awake relay also claims the rows written
// unpublished (see jobstore.Store.ClaimUnpublished): none of them is a
// job a caller just committed for now, so they wait up to this long, and
// the outbox alone is read every AwakePoll.
var legacyPoll = 50 * time.Millisecond // a variable for tests only

// claim takes the next batch off the outbox and, when legacy, of the rows
// written unpublished; the two full flags say whether each source may hold
// more. Each source is tried whatever the other does: an outbox the relay
// cannot read must not hold up waits, hand-backs and replays.
func (r *Relay) claim(ctx context.Context, outbox, legacy bool) (jobs []idempotency.Job, outboxFull, legacyFull bool, err error) {
	if outbox {
		var taken int
		jobs, taken, err = r.store.ClaimOutbox(ctx, r.cfg.BatchSize)
		outboxFull = err == nil && taken == r.cfg.BatchSize
	}
	if legacy {
		more, lerr := r.store.ClaimUnpublished(ctx, r.cfg.BatchSize)
		jobs, legacyFull = append(jobs, more...), lerr == nil && len(more) == r.cfg.BatchSize
		err = errors.Join(err, lerr)
	}
	return jobs, outboxFull, legacyFull, err
}

// drain publishes batches until each source comes back short; legacy: the
// rows written unpublished too. It claims the next batch while it
// publishes one (each claim commits on its own), so the ledger's work and
// Redis's overlap.
func (r *Relay) drain(ctx context.Context, legacy bool) (int, error) {
	cctx, stop := context.WithCancel(ctx)
	defer stop()
	batches := make(chan []idempotency.Job, 1)
	claimErr := make(chan error, 1)
	go func() {
		defer close(batches)
		var errs error
		defer func() { claimErr <- errs }()
		outbox := true
		for outbox || legacy {
			// A source that failed reports itself short: it stops, the
			// other goes on.
			jobs, outboxFull, legacyFull, err := r.claim(cctx, outbox, legacy)
			if err != nil {
				errs = errors.Join(errs, fmt.Errorf("keel relay: %w", err))
			}
			if len(jobs) > 0 {
				select {
				case batches <- jobs:
				case <-cctx.Done():
					r.handBack(ctx, jobs)
					return
				}
			}
			outbox, legacy = outboxFull, legacyFull
		}
	}()
	total := 0
	var err error
	for jobs := range batches {
		if err != nil {
			r.handBack(ctx, jobs)
			continue
		}
		n, perr := r.publish(ctx, jobs)
		total += n
		if perr != nil {
			err = perr
			stop()
		}
	}
	if err == nil {
		select {
		case err = <-claimErr:
		default:
		}
	}
	return total, err
}

// wakeUp tries to become the awake relay. While it waits for the awake lock
// writers do not notify, so if it does not get it, it settles, unless
// another relay holds the lock: that one waits for them.
func (r *Relay) wakeUp(ctx context.Context, locks *relayLocks) relayState {
	got, err := locks.lockAwake(ctx)
	switch {
	case err != nil:
		r.cfg.Logger.Debug("keel relay: could not take the awake lock", "err", err)
		locks.close()
		return settling
	case got:
		return awake
	}
	other, err := locks.awakeHeld(ctx)
	if err == nil && other {
		return asleep
	}
	return settling
}

// settle returns asleep once every writer that did not notify has ended and
// one last pass has published what they wrote, and how many it published.
func (r *Relay) settle(ctx context.Context, locks *relayLocks) (relayState, int) {
	got, err := locks.try(ctx, ledger.RelaySettleLock)
	if err != nil {
		locks.close()
		return settling, 0
	}
	if !got {
		return settling, 0
	}
	defer func() {
		if err := locks.unlock(ctx, ledger.RelaySettleLock); err != nil {
			locks.close()
		}
	}()
	n, err := r.drain(ctx, true)
	if err != nil {
		r.cfg.Logger.Warn("keel relay: publish pass failed", "err", err)
		return settling, n
	}
	return asleep, n
}

// relayLocks holds the relay's session-level advisory locks on a connection
// of their own, taken from the pool when first needed; closing it lets go
// of every lock.
type relayLocks struct {
	pool *pgxpool.Pool
	conn *pgx.Conn
}

// awakeLockTimeout bounds the wait for the awake lock: writers that took it
// shared to notify hold it until they commit, which is quick.
const awakeLockTimeout = 20 * time.Millisecond

func (l *relayLocks) get(ctx context.Context) (*pgx.Conn, error) {
	if l.conn != nil {
		return l.conn, nil
	}
	pc, err := l.pool.Acquire(ctx)
	if err != nil {
		return nil, err
	}
	// Session locks must not go back to the pool with the connection.
	conn := pc.Hijack()
	if _, err := conn.Exec(ctx, fmt.Sprintf("SET lock_timeout = %d", awakeLockTimeout.Milliseconds())); err != nil {
		conn.Close(context.Background())
		return nil, err
	}
	l.conn = conn
	return conn, nil
}

// lockAwake waits up to awakeLockTimeout for the awake lock.
func (l *relayLocks) lockAwake(ctx context.Context) (bool, error) {
	conn, err := l.get(ctx)
	if err != nil {
		return false, err
	}
	err = ledger.LockRelayAwake(ctx, conn)
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "55P03" { // lock_not_available
		return false, nil
	}
	return err == nil, err
}

// awakeHeld tells whether another session holds the awake lock.
func (l *relayLocks) awakeHeld(ctx context.Context) (bool, error) {
	conn, err := l.get(ctx)
	if err != nil {
		return false, err
	}
	return ledger.RelayAwakeHeld(ctx, conn)
}

// try takes lock (a ledger.Relay…Lock) exclusively if it is free.
func (l *relayLocks) try(ctx context.Context, lock string) (bool, error) {
	conn, err := l.get(ctx)
	if err != nil {
		return false, err
	}
	return ledger.TryRelayLock(ctx, conn, lock)
}

// unlock lets go of lock.
func (l *relayLocks) unlock(ctx context.Context, lock string) error {
	if l.conn == nil {
		return errors.New("keel relay: no lock connection")
	}
	held, err := ledger.UnlockRelay(ctx, l.conn, lock)
	if err != nil {
		return err
	}
	if !held {
		return errors.New("keel relay: lock was not held")
	}
	return nil
}

// close lets go of every lock.
func (l *relayLocks) close() {
	if l.conn != nil {
		l.conn.Close(context.Background())
		l.conn = nil
	}
}

// listen turns ledger notifications into wake-ups, reconnecting after errors.
func (r *Relay) listen(ctx context.Context, wake chan<- struct{}) {
	for ctx.Err() == nil {
		err := r.listenOnce(ctx, wake)
		if ctx.Err() != nil {
			return
		}
		r.cfg.Logger.Debug("keel relay: listen connection lost", "err", err)
		select {
		case <-ctx.Done():
			return
		case <-time.After(r.cfg.PollInterval):
		}
	}
}

func (r *Relay) listenOnce(ctx context.Context, wake chan<- struct{}) error {
	pc, err := r.pool.Acquire(ctx)
	if err != nil {
		return err
	}
	// A LISTENing connection must not go back to the pool.
	conn := pc.Hijack()
	defer conn.Close(context.Background())
	if err := ledger.ListenRelay(ctx, conn); err != nil {
		return err
	}
	r.listening.Store(true)
	defer r.listening.Store(false)
	r.signals.Listening.Signal(struct{}{})
	for {
		if _, err := conn.WaitForNotification(ctx); err != nil {
			return err
		}
		select {
		case wake <- struct{}{}:
		default:
		}
	}
}

// PublishBatch publishes one batch off the outbox and one of the rows
// written unpublished (up to BatchSize each) and returns how many it
// published.
func (r *Relay) PublishBatch(ctx context.Context) (int, error) {
	jobs, _, _, err := r.claim(ctx, true, true)
	n, perr := r.publish(ctx, jobs)
	if err != nil {
		return n, fmt.Errorf("keel relay: %w", err)
	}
	return n, perr
}

// publish publishes claimed jobs, hands back those it could not, and returns
// how many it published; an error when it published none of them.
func (r *Relay) publish(ctx context.Context, jobs []idempotency.Job) (int, error) {
	res, backErr := r.store.PublishClaimed(ctx, r.pub, jobs)
	n, failed := 0, 0
	var pubErr error
	for i, p := range res {
		if p.Err == nil {
			n++
			continue
		}
		pubErr = p.Err
		failed++
		// One job Redis refuses must not hold up the rest of the batch.
		if failed <= 3 {
			r.cfg.Logger.Warn("keel relay: could not publish job", "job_id", jobs[i].ID, "kind", jobs[i].Kind, "err", p.Err)
		}
	}
	if backErr != nil {
		r.cfg.Logger.Warn("keel relay: could not hand back unpublished jobs", "jobs", failed, "err", backErr)
	}
	r.published.Add(uint64(n))
	if pubErr != nil && n == 0 {
		return 0, fmt.Errorf("keel relay: %w", pubErr)
	}
	return n, nil
}

// handBack returns claimed jobs to the relays. Without the ledger the
// reconciler republishes them after its grace.
func (r *Relay) handBack(ctx context.Context, jobs []idempotency.Job) {
	if len(jobs) == 0 {
		return
	}
	ids := make([]string, len(jobs))
	for i, j := range jobs {
		ids[i] = j.ID
	}
	if err := r.store.Unpublish(context.WithoutCancel(ctx), ids); err != nil {
		r.cfg.Logger.Warn("keel relay: could not hand back unpublished jobs", "jobs", len(ids), "err", err)
	}
}
