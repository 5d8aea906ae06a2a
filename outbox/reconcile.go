package outbox

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	"go.opentelemetry.io/otel/trace"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/asynqwire"
	"github.com/keeljobs/keel/internal/jobstore"
	"github.com/keeljobs/keel/internal/ledger"
	"github.com/keeljobs/keel/internal/redisconn"
	"github.com/keeljobs/keel/internal/testsignal"
)

// Defaults of ReconcilerConfig.
const (
	// DefaultReconcileInterval: with DefaultGrace, a job Redis lost is
	// published again 10–15s after the loss (plus the pass itself, well
	// under a second per 10,000 open jobs), inside keel's 30s promise. A
	// pass reads the open rows in pages without payloads and looks them up
	// in Redis in one pipeline per page, so a short interval is cheap.
	DefaultReconcileInterval = 5 * time.Second
	// DefaultGrace covers the time between a ledger write and the Redis
	// write that follows it (the relay's claim and its publish, a recorded
	// failure and asynq's retry entry): milliseconds, with room for a
	// stalled process or a slow Redis. Both ends of the comparison are
	// Postgres's clock, so skew between hosts does not shorten it.
	DefaultGrace          = 10 * time.Second
	DefaultReconcileBatch = 1000
	DefaultRetention      = 30 * 24 * time.Hour
	DefaultPruneBatch     = 1000
	// DefaultPruneInterval: pruning is not urgent, and its delete need
	// not run at the reconcile pass's pace.
	DefaultPruneInterval = time.Minute
	// DefaultDeadDropNotice: a day between the alert that seen dead
	// letters are past their kind's bound and their drop, so the alert
	// reaches a person on call whatever the hour.
	DefaultDeadDropNotice = 24 * time.Hour
)

// ReconcilerConfig configures a Reconciler.
type ReconcilerConfig struct {
	// Pool holds the ledger. Required.
	Pool *pgxpool.Pool
	// Redis holds the queues the ledger is compared with. Required.
	Redis asynq.RedisConnOpt
	// Interval between passes over the open jobs. Default:
	// DefaultReconcileInterval (5s).
	Interval time.Duration
	// Grace is how long a job must have been left alone before its absence
	// from Redis counts as lost; it covers jobs in flight between the two
	// stores. Default: DefaultGrace (10s).
	Grace time.Duration
	// RescueInterval is how often Rescue looks for running jobs whose
	// worker is gone. Default: DefaultRescueInterval (1s); negative disables
	// rescuing (asynq's own recovery then redelivers them after a minute or
	// two).
	RescueInterval time.Duration
	// BatchSize is how many ledger rows one query reads. Default:
	// DefaultReconcileBatch (1000).
	BatchSize int
	// Retention is how long succeeded, discarded and cancelled jobs are
	// kept where their kind has no retention policy of its own (keel
	// retention, tasks.Keep). It is also the dedupe window of a business
	// key: after it, the same key makes a new job. Dead jobs are kept
	// unless their kind bounds them. Default: DefaultRetention (30 days);
	// negative disables pruning, policies and dead-letter bounds included.
	Retention time.Duration
	// DeadDropNotice is how long a seen dead letter past its kind's bound
	// waits, alerted (keel_dead_letters_to_drop), before it is dropped.
	// Default: DefaultDeadDropNotice (24h).
	DeadDropNotice time.Duration
	// PruneBatch is how many rows one delete removes. Default:
	// DefaultPruneBatch (1000).
	PruneBatch int
	// PruneInterval is the time between prunes. Default:
	// DefaultPruneInterval (1m).
	PruneInterval time.Duration
	// Logger; default slog.Default().
	Logger *slog.Logger
	// TracerProvider records a keel.publish span for each traced job a
	// pass publishes again. Default: the global provider.
	TracerProvider trace.TracerProvider
	// OnDead is called for each job a pass finds past its deadline and
	// records as dead instead of publishing it again (asynq would only
	// fail it unrun), and for each death whose worker was killed before
	// its own OnDead returned (the ledger keeps the alert owed), Grace
	// after the death. server.New sets the worker's own (its alerts);
	// default: the death is logged at Error level.
	OnDead func(ctx context.Context, e idempotency.DeadEvent)
}

// Validate reports everything in c that cannot work.
func (c ReconcilerConfig) Validate() error {
	var errs []error
	if c.Pool == nil {
		errs = append(errs, errors.New("keel: outbox.ReconcilerConfig.Pool is required"))
	}
	if c.Redis == nil {
		errs = append(errs, errors.New("keel: outbox.ReconcilerConfig.Redis is required"))
	}
	errs = append(errs, notNegative("ReconcilerConfig.Interval", c.Interval),
		notNegative("ReconcilerConfig.Grace", c.Grace),
		notNegative("ReconcilerConfig.BatchSize", c.BatchSize),
		notNegative("ReconcilerConfig.PruneBatch", c.PruneBatch),
		notNegative("ReconcilerConfig.PruneInterval", c.PruneInterval),
		notNegative("ReconcilerConfig.DeadDropNotice", c.DeadDropNotice))
	return errors.Join(errs...)
}

// WithDefaults returns c with each unset field at its default.
func (c ReconcilerConfig) WithDefaults() ReconcilerConfig {
	if c.Interval == 0 {
		c.Interval = DefaultReconcileInterval
	}
	if c.Grace == 0 {
		c.Grace = DefaultGrace
	}
	if c.RescueInterval == 0 {
		c.RescueInterval = DefaultRescueInterval
	}
	if c.BatchSize == 0 {
		c.BatchSize = DefaultReconcileBatch
	}
	if c.Retention == 0 {
		c.Retention = DefaultRetention
	}
	if c.PruneBatch == 0 {
		c.PruneBatch = DefaultPruneBatch
	}
	if c.PruneInterval == 0 {
		c.PruneInterval = DefaultPruneInterval
	}
	if c.DeadDropNotice == 0 {
		c.DeadDropNotice = DefaultDeadDropNotice
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.OnDead == nil {
		log := c.Logger
		c.OnDead = func(ctx context.Context, e idempotency.DeadEvent) { e.LogDied(ctx, log) }
	}
	return c
}

// Reconciler makes Redis agree with the ledger again when they drift: jobs
// the ledger says should run but Redis no longer holds (a restart without
// persistence, FLUSHALL, a failover that lost writes) are published again;
// jobs of workers that are gone are handed back to Redis at once (Rescue);
// finished jobs past their retention are pruned; a job it finds past its
// deadline, which asynq would fail unrun, it ends (dead, or expired) rather
// than publish again; a death whose worker was killed before it alerted it
// is alerted. It never touches succeeded, discarded or dead jobs'
// state, and publishes with the ledger
// id, so a job Redis still holds is never doubled. Any number can run: a
// pass takes an advisory lock and others skip it; rescues are idempotent.
type Reconciler struct {
	pool  *pgxpool.Pool
	store *jobstore.Store
	pub   *jobstore.Publisher
	rdb   redis.UniversalClient
	cfg   ReconcilerConfig

	repaired, takenOver, rescued, pruned, prunedBatches, settled, owedAlerts atomic.Uint64

	retained retained

	signals reconcileSignals
	// afterPauses, set by tests, runs in a pass after its pause step.
	afterPauses func()
}

// reconcileSignals tell tests what Run did, so they wait on it rather than
// on the clock; off in production (see export_test.go).
type reconcileSignals struct {
	// Passed is what each pass of Run did (repair, settle, prune, owed
	// alerts), sent once it is over.
	Passed testsignal.Signal[reconcilePass]
	// Rescued is each rescue of Run, sent once it is over.
	Rescued testsignal.Signal[rescuePass]
}

// reconcilePass is one pass of Run, as reconcileSignals report it.
type reconcilePass struct {
	// Published is what Reconcile returned: the jobs Redis had lost and
	// those taken off the outbox.
	Published int
	// ReconcileStats is the pass's share of the counters, Rescued aside:
	// rescues run on their own.
	ReconcileStats
	Err error
}

// rescuePass is one rescue of Run: how many jobs it handed back.
type rescuePass struct {
	Rescued int
	Err     error
}

// NewReconciler returns a reconciler; Run it, then Close it. It fails when
// cfg.Validate does.
func NewReconciler(cfg ReconcilerConfig) (*Reconciler, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	pool := cfg.Pool
	rdb, ok := redisconn.Follow(cfg.Redis).MakeRedisClient().(redis.UniversalClient)
	if !ok {
		return nil, fmt.Errorf("keel: outbox.ReconcilerConfig.Redis: %T does not make a go-redis client", cfg.Redis)
	}
	return &Reconciler{pool: pool, store: jobstore.NewStore(pool).WithTracerProvider(cfg.TracerProvider), pub: jobstore.NewPublisherOn(rdb),
		rdb: rdb, cfg: cfg.WithDefaults()}, nil
}

// Close releases Redis connections.
func (r *Reconciler) Close() error { return r.rdb.Close() }

// ReconcileStats counts what reconcilers did.
type ReconcileStats struct {
	// Republished: jobs Redis had lost, published again.
	Republished uint64
	// TakenOver: jobs no relay took off the outbox within OutboxTakeover,
	// published by the reconciler (none while a relay runs).
	TakenOver uint64
	// Rescued: jobs of workers that are gone, handed back to Redis.
	Rescued uint64
	// LeasesReleased is Rescued, under the name of the ledger-side release
	// that Rescue replaced (metrics still export it).
	LeasesReleased uint64
	Pruned         uint64
	// PrunedBatches: batch rows removed once their members were pruned.
	PrunedBatches uint64
	// Settled: asynq copies of finished jobs that asynq still showed as
	// running (a lost acknowledgement, after a failover) removed.
	Settled uint64
	// OwedAlerts: deaths whose worker stopped before its OnDead returned,
	// alerted by a pass.
	OwedAlerts uint64
}

// Stats returns this reconciler's counters.
func (r *Reconciler) Stats() ReconcileStats {
	rescued := r.rescued.Load()
	return ReconcileStats{Republished: r.repaired.Load(), TakenOver: r.takenOver.Load(), Rescued: rescued, LeasesReleased: rescued, Pruned: r.pruned.Load(),
		PrunedBatches: r.prunedBatches.Load(), Settled: r.settled.Load(), OwedAlerts: r.owedAlerts.Load()}
}

// minus is what s counts beyond before, but for rescues, which run apart
// from passes.
func (s ReconcileStats) minus(before ReconcileStats) ReconcileStats {
	return ReconcileStats{Republished: s.Republished - before.Republished, TakenOver: s.TakenOver - before.TakenOver, Pruned: s.Pruned - before.Pruned,
		PrunedBatches: s.PrunedBatches - before.PrunedBatches, Settled: s.Settled - before.Settled,
		OwedAlerts: s.OwedAlerts - before.OwedAlerts}
}

// Run rescues every RescueInterval, reconciles every Interval and prunes
// every PruneInterval until ctx ends. Rescues run on their own, so a long
// pass never delays them.
func (r *Reconciler) Run(ctx context.Context) error {
	var wg sync.WaitGroup
	if r.cfg.RescueInterval > 0 {
		wg.Go(func() {
			r.every(ctx, r.cfg.RescueInterval, "rescue", func(ctx context.Context) (int, error) {
				n, err := r.Rescue(ctx)
				r.signals.Rescued.Signal(rescuePass{Rescued: n, Err: err})
				return n, err
			})
		})
	}
	var lastPrune time.Time
	r.every(ctx, r.cfg.Interval, "pass", func(ctx context.Context) (int, error) {
		var before ReconcileStats
		if r.signals.Passed.On() {
			before = r.Stats()
		}
		n, err := r.Reconcile(ctx)
		_, serr := r.SettleFinished(ctx)
		if serr != nil && ctx.Err() == nil {
			r.cfg.Logger.Warn("keel reconciler: settling finished jobs asynq still runs failed", "err", serr)
		}
		var perr error
		if r.cfg.Retention > 0 && time.Since(lastPrune) >= r.cfg.PruneInterval && ctx.Err() == nil {
			lastPrune = time.Now()
			if _, perr = r.Prune(ctx); perr != nil && ctx.Err() == nil {
				r.cfg.Logger.Warn("keel reconciler: prune failed", "err", perr)
			}
		}
		if r.signals.Passed.On() {
			r.signals.Passed.Signal(reconcilePass{Published: n, ReconcileStats: r.Stats().minus(before), Err: errors.Join(err, serr, perr)})
		}
		return n, err
	})
	wg.Wait()
	return nil
}

// every runs fn now and then every d until ctx ends.
func (r *Reconciler) every(ctx context.Context, d time.Duration, what string, fn func(context.Context) (int, error)) {
	t := time.NewTicker(d)
	defer t.Stop()
	for {
		if _, err := fn(ctx); err != nil && ctx.Err() == nil {
			r.cfg.Logger.Warn("keel reconciler: "+what+" failed", "err", err)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// OutboxTakeover is how long a job may wait on the relay's outbox before a
// reconciler takes it off and publishes it: that long, no relay reads the
// outbox (only older binaries' relays run, mid-deploy, or none), or the
// relays are that far behind, and taking rows as they do, the reconciler
// only helps them.
const OutboxTakeover = time.Minute

// Reconcile runs one full pass over the open jobs and returns how many it
// published again. It returns 0 without work when another pass holds the
// lock. A page costs one query and one Redis pipeline; payloads are read
// only for the jobs it publishes again, so memory stays at one page however
// many jobs are open.
func (r *Reconciler) Reconcile(ctx context.Context) (int, error) {
	conn, err := r.pool.Acquire(ctx)
	if err != nil {
		return 0, err
	}
	defer conn.Release()
	// One lock per ledger: keyed by schema, so ledgers in other schemas of
	// the same database do not wait for each other.
	if got, err := ledger.TryReconcileLock(ctx, conn); err != nil || !got {
		return 0, err
	}
	defer ledger.ReconcileUnlock(context.WithoutCancel(ctx), conn) //nolint:errcheck // dropped with the session anyway

	if err := r.payOwedAlerts(ctx); err != nil && ctx.Err() == nil {
		r.cfg.Logger.Warn("keel reconciler: owed alerts not sent; the next pass tries again", "err", err)
	}
	if err := r.applyPauses(ctx); err != nil && ctx.Err() == nil {
		r.cfg.Logger.Warn("keel reconciler: paused queues not checked in Redis; the next pass tries again", "err", err)
	}
	if r.afterPauses != nil {
		r.afterPauses()
	}
	if err := r.endHeldPastDeadline(ctx); err != nil && ctx.Err() == nil {
		r.cfg.Logger.Warn("keel reconciler: held jobs past their deadline not ended; the next pass tries again", "err", err)
	}
	repaired, err := r.takeOverOutbox(ctx)
	if err != nil {
		return repaired, err
	}
	cursor := ""
	for {
		page, err := ledger.ReconcilePage(ctx, conn, r.cfg.Grace, cursor, r.cfg.BatchSize, nil)
		if err != nil || len(page) == 0 {
			return repaired, err
		}
		cursor = page[len(page)-1].ID
		n, err := r.reconcilePage(ctx, page)
		repaired += n
		r.repaired.Add(uint64(n))
		if err != nil || len(page) < r.cfg.BatchSize {
			return repaired, err
		}
	}
}

// takeOverOutbox publishes the jobs that have waited on the outbox for
// OutboxTakeover, taking their rows off as a relay does, so each is
// published by one of them. A job Redis refuses goes back to the relay
// (Unpublish).
func (r *Reconciler) takeOverOutbox(ctx context.Context) (int, error) {
	total := 0
	for {
		jobs, taken, err := r.store.TakeOverOutbox(ctx, r.cfg.BatchSize, OutboxTakeover)
		if err != nil || taken == 0 {
			return total, err
		}
		res, backErr := r.store.PublishClaimed(ctx, r.pub, jobs)
		failed := 0
		var pubErr error
		for _, p := range res {
			if p.Err != nil {
				failed, pubErr = failed+1, p.Err
				continue
			}
			total++
			r.takenOver.Add(1)
		}
		if len(jobs) > 0 {
			r.cfg.Logger.Warn("keel reconciler: published jobs no relay took off the outbox for a minute; is a relay running?",
				"jobs", len(jobs)-failed)
		}
		if failed > 0 {
			return total, errors.Join(fmt.Errorf("keel reconciler: %d jobs taken off the outbox not published: %w", failed, pubErr), backErr)
		}
		if taken < r.cfg.BatchSize {
			return total, nil
		}
	}
}

func (r *Reconciler) reconcilePage(ctx context.Context, page []ledger.OpenJob) (int, error) {
	ids, queues := make([]string, 0, len(page)), make([]string, 0, len(page))
	for _, j := range page {
		if !j.Held { // a live worker runs it; its Redis copy may be gone already
			ids, queues = append(ids, j.ID), append(queues, j.Queue)
		}
	}
	states, err := taskStates(ctx, r.rdb, queues, ids)
	if err != nil {
		return 0, fmt.Errorf("keel reconciler: look up jobs in Redis: %w", err)
	}
	var lost, active []string
	activeQueue := map[string]string{}
	for i, st := range states {
		switch st {
		case asynqwire.StateActive:
			// Not held in the ledger, yet asynq says a worker has it: the
			// worker died between asynq's dequeue and the ledger's claim, or
			// between recording a failure and asynq's retry. Only asynq's
			// recoverer (a minute or more) would notice.
			active = append(active, ids[i])
			activeQueue[ids[i]] = queues[i]
		case "":
			lost = append(lost, ids[i])
		case asynqwire.StateArchived:
			// The job's failure was never recorded, or another deployment's
			// worker refused it: drift too. The archived copy holds its id.
			if _, err := asynqwire.DeleteInSet(ctx, r.rdb, queues[i], asynqwire.StateArchived, ids[i]); err != nil {
				return 0, fmt.Errorf("keel reconciler: remove archived copy of open job %s: %w", ids[i], err)
			}
			lost = append(lost, ids[i])
		}
	}
	if len(active) > 0 {
		now := time.Now()
		live, err := runningOnLiveServer(ctx, r.rdb, active, now)
		if err != nil {
			return 0, fmt.Errorf("keel reconciler: read asynq's worker lists: %w", err)
		}
		for _, id := range active {
			if live[id] {
				continue
			}
			moved, err := requeueActive(ctx, r.rdb, activeQueue[id], id, now)
			if err != nil {
				return 0, fmt.Errorf("keel reconciler: hand back job %s held by a gone worker: %w", id, err)
			}
			if moved == 1 {
				r.rescued.Add(1)
				r.cfg.Logger.Info("keel reconciler: job a gone worker took from Redis before claiming it handed back", "job_id", id)
			}
		}
	}
	return r.republish(ctx, lost, func(j idempotency.Job) bool {
		switch j.Status {
		case idempotency.StatusPending, idempotency.StatusFailed:
			return true
		case idempotency.StatusRunning:
			return j.LeaseUntil == nil || j.LeaseUntil.Before(time.Now())
		}
		return false
	}, "keel reconciler: job missing from Redis, published again")
}

// republish publishes again those of jobs ids that keep accepts, reading
// their rows (payloads) now. A job Redis holds after all (published by
// someone else meanwhile) is a task id conflict and not counted.
func (r *Reconciler) republish(ctx context.Context, ids []string, keep func(idempotency.Job) bool, msg string) (int, error) {
	if len(ids) == 0 {
		return 0, nil
	}
	jobs, err := r.store.GetMany(ctx, r.pool, ids)
	if err != nil {
		return 0, err
	}
	jobs = slices.DeleteFunc(jobs, func(j idempotency.Job) bool { return !keep(j) })
	if jobs, err = r.endPastDeadline(ctx, jobs); err != nil || len(jobs) == 0 {
		return 0, err
	}
	// asynq lists a queue in its registry only on a client's first enqueue,
	// so after Redis lost everything long-lived clients refill queues nobody
	// lists, and asynqmon, the inspector and the metrics cannot see them.
	// Listing them again is what any first enqueue does.
	var qs []any
	for _, j := range jobs {
		if !slices.Contains(qs, any(j.Queue)) {
			qs = append(qs, j.Queue)
		}
	}
	if err := r.rdb.SAdd(ctx, asynqwire.QueuesKey, qs...).Err(); err != nil {
		return 0, fmt.Errorf("keel reconciler: list queues %v: %w", qs, err)
	}
	// Redis may have lost the pauses too since this pass put them back: a
	// job published into a queue whose pause is not back yet is one any
	// worker may run.
	if err := r.applyPauses(ctx); err != nil {
		return 0, fmt.Errorf("keel reconciler: pause queues again before publishing: %w", err)
	}
	// A failed job goes back for its retry at the time the ledger recorded
	// (a time already past, as rows from before that was recorded have,
	// publishes it at once).
	res, markErr := r.store.PublishMany(ctx, r.pub, jobs)
	n, failed := 0, 0
	var pubErr error
	for i, p := range res {
		switch {
		case p.Err != nil:
			failed++
			pubErr = p.Err
		case p.New:
			n++
			r.cfg.Logger.Warn(msg, "job_id", jobs[i].ID, "kind", jobs[i].Kind, "status", jobs[i].Status)
		}
	}
	if pubErr != nil {
		pubErr = fmt.Errorf("%d of %d jobs not published again, last: %w", failed, len(jobs), pubErr)
	}
	return n, errors.Join(pubErr, markErr)
}

// endPastDeadline ends the jobs whose deadline has passed, which asynq
// would fail unrun however often they were published, and returns the
// others.
func (r *Reconciler) endPastDeadline(ctx context.Context, jobs []idempotency.Job) ([]idempotency.Job, error) {
	var past []string
	now := time.Now()
	for _, j := range jobs {
		if j.Deadline != nil && !j.Deadline.After(now) {
			past = append(past, j.ID)
		}
	}
	if len(past) == 0 {
		return jobs, nil
	}
	deaths, expired, err := r.store.EndPastDeadline(ctx, past)
	if err != nil {
		return nil, fmt.Errorf("keel reconciler: end jobs past their deadline: %w", err)
	}
	if err := r.died(ctx, deaths); err != nil {
		return nil, err
	}
	if len(expired) > 0 {
		r.cfg.Logger.Info("keel reconciler: jobs expired at their deadline before they could run", "jobs", len(expired))
	}
	return slices.DeleteFunc(jobs, func(j idempotency.Job) bool { return slices.Contains(past, j.ID) }), nil
}

// payOwedAlerts runs OnDead for the deaths whose worker was killed before
// its own hook returned, once the grace has passed since the death.
func (r *Reconciler) payOwedAlerts(ctx context.Context) error {
	for {
		owed, err := r.store.OwedAlerts(ctx, r.cfg.Grace, r.cfg.BatchSize)
		if err != nil {
			return fmt.Errorf("keel reconciler: read the deaths whose alert is owed: %w", err)
		}
		if len(owed) > 0 {
			r.cfg.Logger.Warn("keel reconciler: alerting deaths whose worker stopped before it alerted them", "jobs", len(owed))
		}
		err = r.died(ctx, owed)
		r.owedAlerts.Add(uint64(len(owed)))
		if err != nil || len(owed) < r.cfg.BatchSize {
			return err
		}
	}
}

// died runs OnDead for deaths the ledger has recorded and records their
// alerts paid.
func (r *Reconciler) died(ctx context.Context, deaths []idempotency.DeadEvent) error {
	if len(deaths) == 0 {
		return nil
	}
	ids := make([]string, len(deaths))
	for i, e := range deaths {
		r.onDead(ctx, e)
		ids[i] = e.JobID
	}
	if err := r.store.AlertsPaid(ctx, ids...); err != nil {
		return fmt.Errorf("keel reconciler: record %d alerts as sent: %w", len(ids), err)
	}
	return nil
}

// onDead runs the hook; one that panics is logged, not let loose on the
// pass (and the worker it runs in).
func (r *Reconciler) onDead(ctx context.Context, e idempotency.DeadEvent) {
	defer func() {
		if p := recover(); p != nil {
			r.cfg.Logger.Error("keel reconciler: the OnDead hook panicked", "job_id", e.JobID, "panic", p, "stack", string(debug.Stack()))
		}
	}()
	r.cfg.OnDead(ctx, e)
}

// Prune deletes succeeded, discarded and cancelled jobs (their steps,
// progress and result go with them) finished longer ago than their kind's
// retention, or Retention, and the seen dead letters past their kind's
// bounds a notice after it alerted them, in small batches so it never holds
// long locks. See retention.go.
func (r *Reconciler) Prune(ctx context.Context) (int, error) {
	return r.prune(ctx, nil)
}

func (r *Reconciler) prune(ctx context.Context, now ledger.Now) (int, error) {
	if r.cfg.Retention <= 0 {
		return 0, nil
	}
	plan, err := ledger.PlanPrune(ctx, r.pool, r.cfg.Retention)
	if err != nil {
		return 0, err
	}
	total, err := r.pruneKinds(ctx, plan.Finished, now)
	// The jobs are gone whatever happens next: count them first.
	if total > 0 {
		r.pruned.Add(uint64(total))
		if lerr := ledger.LogPrune(ctx, r.pool, total, now); lerr != nil {
			return total, errors.Join(err, lerr)
		}
		if lerr := ledger.TrimPruneLog(ctx, r.pool, now); lerr != nil {
			return total, errors.Join(err, lerr)
		}
	}
	if err != nil {
		return total, err
	}
	dropped, err := r.boundDeadLetters(ctx, plan.Dead, now)
	total += dropped
	if dropped > 0 {
		if lerr := ledger.LogPrune(ctx, r.pool, dropped, now); lerr != nil {
			return total, errors.Join(err, lerr)
		}
	}
	if err != nil {
		return total, err
	}
	for ctx.Err() == nil {
		n, err := ledger.PruneBatches(ctx, r.pool, r.cfg.Retention, r.cfg.PruneBatch, now)
		if err != nil {
			return total, fmt.Errorf("prune batches: %w", err)
		}
		r.prunedBatches.Add(uint64(n))
		if n < r.cfg.PruneBatch {
			break
		}
	}
	return total, nil
}
