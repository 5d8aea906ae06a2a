package metrics

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/keeljobs/keel/inspect"
	"github.com/keeljobs/keel/internal/cronspec"
	"github.com/keeljobs/keel/internal/ledger"
)

// DefaultScrapeTimeout bounds the reads one scrape of a Ledger makes.
const DefaultScrapeTimeout = 5 * time.Second

// DefaultScheduleGrace is LedgerConfig.ScheduleGrace's default: well past
// a scheduler's retries of a tick it could not enqueue (30 s apart at
// most).
const DefaultScheduleGrace = 2 * time.Minute

// LedgerConfig configures a Ledger collector.
type LedgerConfig struct {
	// Pool holds the ledger. Nil: no dead-letter or outbox metrics.
	Pool *pgxpool.Pool
	// Inspector reads asynq's queues. Nil: no queue metrics. The caller
	// closes it.
	Inspector *asynq.Inspector
	// Timeout bounds each scrape's reads. Default: DefaultScrapeTimeout.
	Timeout time.Duration
	// ScheduleGrace is how long past due a cron entry's tick may be before
	// keel_schedule_entries{state="overdue"} counts it. Default:
	// DefaultScheduleGrace.
	ScheduleGrace time.Duration
}

// Validate reports everything in c that cannot work.
func (c LedgerConfig) Validate() error {
	var errs []error
	if c.Timeout < 0 {
		errs = append(errs, fmt.Errorf("keel: metrics.LedgerConfig.Timeout must not be negative (0 for DefaultScrapeTimeout), got %v", c.Timeout))
	}
	if c.ScheduleGrace < 0 {
		errs = append(errs, fmt.Errorf("keel: metrics.LedgerConfig.ScheduleGrace must not be negative (0 for DefaultScheduleGrace), got %v", c.ScheduleGrace))
	}
	return errors.Join(errs...)
}

// WithDefaults returns c with each unset field at its default.
func (c LedgerConfig) WithDefaults() LedgerConfig {
	if c.Timeout == 0 {
		c.Timeout = DefaultScrapeTimeout
	}
	if c.ScheduleGrace == 0 {
		c.ScheduleGrace = DefaultScheduleGrace
	}
	return c
}

// QueueStates are the task states of keel_queue_size, in asynq's terms.
var QueueStates = []string{"pending", "active", "scheduled", "retry", "archived", "completed", "aggregating"}

// QueueState is one asynq queue at the time of a read.
type QueueState struct {
	Name   string
	Paused bool
	// Size maps each of QueueStates to its number of tasks.
	Size map[string]int
	// OldestPending is the age of the oldest pending task (asynq's latency).
	OldestPending time.Duration
	// ProcessedTotal and FailedTotal are asynq's cumulative counters.
	ProcessedTotal, FailedTotal int
}

// DeadCount is the number of dead letters of one queue, kind and class.
type DeadCount struct {
	Queue, Kind, Class string
	N                  int
}

// WaitingCount is the jobs of one kind waiting for their parents: how
// many, how many of them on a dead parent, and when the oldest was
// enqueued.
type WaitingCount = ledger.WaitingCount

// HeldCount is the jobs of one kind held for a slot of their concurrency
// key (tasks.ConcurrencyKey): how many, on how many keys, and when the
// oldest was held.
type HeldCount = ledger.KindHeld

// Snapshot is what one read of Redis and the ledger found.
type Snapshot struct {
	Queues   []QueueState
	RedisErr error // nil when the queues were read

	Dead []DeadCount
	// OutboxBacklog is how many committed jobs the relay has not yet
	// handed to Redis; OutboxLag is how long the oldest of them has waited.
	OutboxBacklog int
	OutboxLag     time.Duration
	// BatchesOpen counts batches still filling (not sealed); BatchesSealed
	// those sealed and waiting for members.
	BatchesOpen, BatchesSealed int
	// Waiting counts the jobs waiting for their parents, by kind.
	Waiting []WaitingCount
	// PausedQueues are the queues the ledger holds paused (keel queue
	// pause), PausedKinds the kinds (keel kind pause); PausedHeld counts
	// the jobs held as paused, by kind.
	PausedQueues []string
	PausedKinds  []string
	PausedHeld   map[string]int64
	// Held counts the jobs held for a slot of their concurrency key, by
	// kind.
	Held []HeldCount
	// SchedulesPaused counts the cron entries a person paused;
	// SchedulesOverdue those not paused whose next tick is more than
	// ScheduleGrace past due (see keel_schedule_entries).
	SchedulesPaused, SchedulesOverdue int
	PostgresErr                       error // nil when the ledger was read
}

// Ledger is a prometheus.Collector that reads queue sizes from asynq and
// dead letters and the outbox backlog from the ledger at scrape time, so
// every web server (or any process) can export them without a background
// loop. Reads are bounded by a timeout; a source that cannot be read in time
// reports keel_collector_up{source} = 0 and its metrics are left out.
type Ledger struct {
	cfg LedgerConfig
	// redisBusy stops scrapes from piling up goroutines on a Redis that
	// does not answer: asynq's inspector takes no context.
	redisBusy atomic.Bool

	queueSize, oldestPending, paused, dead, backlog, lag, batches, up, duration *prometheus.Desc
	waiting, waitingOnDead, waitingOldest                                       *prometheus.Desc
	queuePausedByKeel, kindPaused, kindHeld                                     *prometheus.Desc
	held, heldKeys, heldOldest                                                  *prometheus.Desc
	schedules                                                                   *prometheus.Desc
}

// NewLedger returns a collector, or the error of cfg.Validate; register it
// on a prometheus.Registerer.
func NewLedger(cfg LedgerConfig) (*Ledger, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return &Ledger{
		cfg: cfg.WithDefaults(),
		queueSize: prometheus.NewDesc("keel_queue_size",
			"Tasks in an asynq queue, by state.", []string{"queue", "state"}, nil),
		oldestPending: prometheus.NewDesc("keel_queue_oldest_pending_seconds",
			"Age of the oldest pending task in a queue (0 when none is pending).", []string{"queue"}, nil),
		paused: prometheus.NewDesc("keel_queue_paused",
			"1 when the queue is paused.", []string{"queue"}, nil),
		dead: prometheus.NewDesc("keel_dead_letters",
			"Dead jobs in the ledger waiting for a person, by queue, kind and error class.", []string{"queue", "kind", "class"}, nil),
		backlog: prometheus.NewDesc("keel_outbox_backlog",
			"Committed jobs the relay has not yet handed to Redis.", nil, nil),
		lag: prometheus.NewDesc("keel_outbox_lag_seconds",
			"How long the oldest job not yet handed to Redis has waited (0 when none).", nil, nil),
		batches: prometheus.NewDesc("keel_batches_open",
			"Batches not complete: state open (members may join) or sealed (waiting for members to end).", []string{"state"}, nil),
		waiting: prometheus.NewDesc("keel_jobs_waiting",
			"Jobs waiting for their parents to succeed (tasks.After, workflows), by kind.", []string{"kind"}, nil),
		waitingOnDead: prometheus.NewDesc("keel_jobs_waiting_on_dead",
			"Waiting jobs with a dead parent: they wait for a person (replay the parent, or release or cancel the job).", []string{"kind"}, nil),
		waitingOldest: prometheus.NewDesc("keel_jobs_waiting_oldest_seconds",
			"Age of the oldest waiting job of a kind.", []string{"kind"}, nil),
		queuePausedByKeel: prometheus.NewDesc("keel_queue_paused_by_keel",
			"1 for each queue the ledger holds paused (keel queue pause); a reconciler pass pauses it in Redis.", []string{"queue"}, nil),
		kindPaused: prometheus.NewDesc("keel_kind_paused",
			"1 for each kind the ledger holds paused (keel kind pause).", []string{"kind"}, nil),
		kindHeld: prometheus.NewDesc("keel_kind_paused_jobs",
			"Jobs held in the ledger because their kind is paused (or their queue, which Redis delivered them without), by kind: they run when the pause ends.", []string{"kind"}, nil),
		held: prometheus.NewDesc("keel_concurrency_held_jobs",
			"Jobs held for a slot of their concurrency key (tasks.ConcurrencyKey), by kind.", []string{"kind"}, nil),
		heldKeys: prometheus.NewDesc("keel_concurrency_held_keys",
			"Concurrency keys of a kind with a job held for a slot.", []string{"kind"}, nil),
		heldOldest: prometheus.NewDesc("keel_concurrency_held_oldest_seconds",
			"How long the oldest job of a kind held for a slot of its concurrency key has waited.", []string{"kind"}, nil),
		schedules: prometheus.NewDesc("keel_schedule_entries",
			"Cron entries by state: paused (by a person), or overdue (not paused, and a tick more than the grace past due: no scheduler fires it).",
			[]string{"state"}, nil),
		up: prometheus.NewDesc("keel_collector_up",
			"1 when the last scrape could read the source (redis or postgres).", []string{"source"}, nil),
		duration: prometheus.NewDesc("keel_collector_scrape_duration_seconds",
			"How long the last scrape of Redis and the ledger took.", nil, nil),
	}, nil
}

// Describe implements prometheus.Collector.
func (l *Ledger) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{l.queueSize, l.oldestPending, l.paused, l.dead, l.backlog, l.lag, l.batches,
		l.waiting, l.waitingOnDead, l.waitingOldest, l.queuePausedByKeel, l.kindPaused, l.kindHeld,
		l.held, l.heldKeys, l.heldOldest, l.schedules, l.up, l.duration} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (l *Ledger) Collect(ch chan<- prometheus.Metric) {
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), l.cfg.Timeout)
	defer cancel()
	s := l.Read(ctx)
	gauge := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
	}
	if l.cfg.Inspector != nil {
		gauge(l.up, boolFloat(s.RedisErr == nil), "redis")
		for _, q := range s.Queues {
			for _, st := range QueueStates {
				gauge(l.queueSize, float64(q.Size[st]), q.Name, st)
			}
			gauge(l.oldestPending, q.OldestPending.Seconds(), q.Name)
			gauge(l.paused, boolFloat(q.Paused), q.Name)
		}
	}
	if l.cfg.Pool != nil {
		gauge(l.up, boolFloat(s.PostgresErr == nil), "postgres")
		if s.PostgresErr == nil {
			for _, d := range s.Dead {
				gauge(l.dead, float64(d.N), d.Queue, d.Kind, d.Class)
			}
			gauge(l.backlog, float64(s.OutboxBacklog))
			gauge(l.lag, s.OutboxLag.Seconds())
			gauge(l.batches, float64(s.BatchesOpen), "open")
			gauge(l.batches, float64(s.BatchesSealed), "sealed")
			for _, w := range s.Waiting {
				gauge(l.waiting, float64(w.N), w.Kind)
				gauge(l.waitingOnDead, float64(w.OnDead), w.Kind)
				gauge(l.waitingOldest, max(time.Since(w.Oldest), 0).Seconds(), w.Kind)
			}
			for _, q := range s.PausedQueues {
				gauge(l.queuePausedByKeel, 1, q)
			}
			for _, k := range s.PausedKinds {
				gauge(l.kindPaused, 1, k)
				gauge(l.kindHeld, float64(s.PausedHeld[k]), k)
			}
			for k, n := range s.PausedHeld {
				if !slices.Contains(s.PausedKinds, k) {
					gauge(l.kindHeld, float64(n), k) // held without a pause: keel kind resume releases them
				}
			}
			for _, h := range s.Held {
				gauge(l.held, float64(h.Held), h.Kind)
				gauge(l.heldKeys, float64(h.Keys), h.Kind)
				gauge(l.heldOldest, max(time.Since(h.OldestHeld), 0).Seconds(), h.Kind)
			}
			gauge(l.schedules, float64(s.SchedulesPaused), "paused")
			gauge(l.schedules, float64(s.SchedulesOverdue), "overdue")
		}
	}
	gauge(l.duration, time.Since(start).Seconds())
}

func boolFloat(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

// Read reads Redis and the ledger at once, each within ctx.
func (l *Ledger) Read(ctx context.Context) Snapshot {
	var s Snapshot
	var wg sync.WaitGroup
	if l.cfg.Inspector != nil {
		wg.Add(1)
		go func() {
			defer wg.Done()
			s.Queues, s.RedisErr = l.readQueues(ctx)
		}()
	}
	if l.cfg.Pool != nil {
		wg.Add(1)
		go func() {
			defer wg.Done()
			s.PostgresErr = l.readLedger(ctx, &s)
		}()
	}
	wg.Wait()
	return s
}

var errRedisBusy = errors.New("keel: an earlier read of Redis has not finished")

func (l *Ledger) readQueues(ctx context.Context) ([]QueueState, error) {
	if !l.redisBusy.CompareAndSwap(false, true) {
		return nil, errRedisBusy
	}
	type result struct {
		qs  []QueueState
		err error
	}
	out := make(chan result, 1)
	go func() {
		defer l.redisBusy.Store(false)
		qs, err := ReadQueues(l.cfg.Inspector)
		out <- result{qs, err}
	}()
	select {
	case r := <-out:
		return r.qs, r.err
	case <-ctx.Done():
		return nil, fmt.Errorf("keel: reading queues from Redis: %w", ctx.Err())
	}
}

// ReadQueues reads every queue asynq knows, sorted by name.
func ReadQueues(insp *asynq.Inspector) ([]QueueState, error) {
	names, err := insp.Queues()
	if err != nil {
		return nil, err
	}
	sort.Strings(names)
	qs := make([]QueueState, 0, len(names))
	for _, name := range names {
		info, err := insp.GetQueueInfo(name)
		if errors.Is(err, asynq.ErrQueueNotFound) {
			continue // removed since Queues
		}
		if err != nil {
			return nil, err
		}
		qs = append(qs, QueueState{
			Name:   name,
			Paused: info.Paused,
			Size: map[string]int{
				"pending": info.Pending, "active": info.Active, "scheduled": info.Scheduled, "retry": info.Retry,
				"archived": info.Archived, "completed": info.Completed, "aggregating": info.Aggregating,
			},
			OldestPending:  info.Latency,
			ProcessedTotal: info.ProcessedTotal,
			FailedTotal:    info.FailedTotal,
		})
	}
	return qs, nil
}

// readLedger reads the ledger's part of s: its statements use the
// ledger's partial indexes and the small outbox table, so a scrape costs
// little however large the table (see internal/ledger).
func (l *Ledger) readLedger(ctx context.Context, s *Snapshot) error {
	dead, err := ledger.DeadLetters(ctx, l.cfg.Pool)
	if err != nil {
		return fmt.Errorf("keel: reading dead letters: %w", err)
	}
	s.Dead = make([]DeadCount, len(dead))
	for i, d := range dead {
		s.Dead[i] = DeadCount{Queue: d.Queue, Kind: d.Kind, Class: d.Class, N: int(d.N)}
	}
	backlog, lag, err := ledger.RelayBacklog(ctx, l.cfg.Pool, nil)
	if err != nil {
		return fmt.Errorf("keel: reading the outbox: %w", err)
	}
	s.OutboxBacklog, s.OutboxLag = int(backlog), max(lag, 0)
	open, sealed, err := ledger.OpenBatches(ctx, l.cfg.Pool)
	if err != nil {
		return fmt.Errorf("keel: reading batches: %w", err)
	}
	s.BatchesOpen, s.BatchesSealed = int(open), int(sealed)
	if s.Waiting, err = ledger.WaitingByKind(ctx, l.cfg.Pool); err != nil {
		return fmt.Errorf("keel: reading waiting jobs: %w", err)
	}
	if s.PausedQueues, err = ledger.PausedQueues(ctx, l.cfg.Pool); err != nil {
		return fmt.Errorf("keel: reading paused queues: %w", err)
	}
	kinds, err := ledger.KindPauses(ctx, l.cfg.Pool)
	if err != nil {
		return fmt.Errorf("keel: reading paused kinds: %w", err)
	}
	for _, k := range kinds {
		s.PausedKinds = append(s.PausedKinds, k.Kind)
	}
	if s.PausedHeld, err = ledger.PausedByKind(ctx, l.cfg.Pool); err != nil {
		return fmt.Errorf("keel: reading jobs held by a kind's pause: %w", err)
	}
	if s.Held, err = ledger.HeldByKind(ctx, l.cfg.Pool); err != nil {
		return fmt.Errorf("keel: reading held jobs: %w", err)
	}
	rows, err := ledger.ScheduleRows(ctx, l.cfg.Pool)
	if err != nil {
		return fmt.Errorf("keel: reading cron entries: %w", err)
	}
	s.SchedulesPaused, s.SchedulesOverdue = scheduleStates(rows, l.cfg.ScheduleGrace)
	return nil
}

// scheduleStates counts the paused and the overdue entries among rows.
// The ledger knows a file's or code's entry only from the schedulers that
// run it, so such an entry counts only while they describe it: one they
// stopped describing more than inspect.RunTimeout before the newest
// description of any entry has left their files. And it is overdue only
// once no scheduler has described anything for RunTimeout: while one
// runs, its own entries' ticks restart with a changed spec, which the
// ledger does not see. A run-time entry, whose spec and changes the
// ledger has, is overdue whenever its next tick after the newest handled
// (or its last change) is more than grace past.
func scheduleStates(rows []ledger.ScheduleRow, grace time.Duration) (paused, overdue int) {
	var newest time.Time
	for _, r := range rows {
		if r.SeenAt != nil && r.SeenAt.After(newest) {
			newest = *r.SeenAt
		}
	}
	for _, r := range rows {
		if !r.RunTime && (r.SeenAt == nil || newest.Sub(*r.SeenAt) > inspect.RunTimeout) {
			continue
		}
		if r.Paused {
			paused++
			continue
		}
		if !r.RunTime && r.Now.Sub(newest) < inspect.RunTimeout {
			continue
		}
		sched, err := cronspec.ParseIn(r.Spec, r.TimeZone)
		if err != nil {
			continue // written by another version: not this one's to judge
		}
		if due := sched.Next(r.Since); !due.IsZero() && r.Now.Sub(due) > grace {
			overdue++
		}
	}
	return paused, overdue
}
