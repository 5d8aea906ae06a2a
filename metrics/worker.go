package metrics

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/retry"
	"github.com/keeljobs/keel/server"
	"github.com/keeljobs/keel/tasks"
)

// DurationBuckets are the default buckets of keel_job_duration_seconds:
// from 5ms up to 10 minutes, as jobs range from a cache write to a report.
var DurationBuckets = []float64{.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600}

// WorkerConfig configures a Worker.
type WorkerConfig struct {
	// Registerer is where the worker's metrics are registered. Required.
	Registerer prometheus.Registerer
	// Classifier names the class label of failures. Default: retry.Default.
	Classifier *retry.Classifier
	// DuplicatesSkipped reports how many deliveries of already finished jobs
	// were acknowledged without running the handler — pass
	// func() uint64 { return guard.Stats().DuplicatesSkipped }. Nil: the
	// metric is not exported.
	DuplicatesSkipped func() uint64
	// Guard reports the ledger guard's counters (pass guard.Stats) for the
	// runs keel gave up or released: handlers that outlived their timeout,
	// runs interrupted by shutdown, poison jobs retired. Nil: not exported.
	Guard func() server.GuardStats
	// Buckets of the duration histogram, in increasing order. Default:
	// DurationBuckets.
	Buckets []float64
	// Kinds are the kinds the worker declares, each with the queue its jobs
	// go to by default. Their job counters (processed, succeeded, postponed,
	// and failed and dead for each of retry.StoredClasses) are exported at 0
	// from the start, so that increase() and rate() see the first event of
	// each and alerts and panels work from the first death. A kind not
	// listed here is still counted, from its first event on.
	Kinds []Kind
}

// Kind names a declared task kind and its default queue (tasks.Kind's Name
// and Queue); an empty Queue is tasks.DefaultQueue.
type Kind struct {
	Name, Queue string
}

// Worker records what a worker's handlers do.
type Worker struct {
	classifier *retry.Classifier
	processed  *prometheus.CounterVec
	succeeded  *prometheus.CounterVec
	failed     *prometheus.CounterVec
	postponed  *prometheus.CounterVec
	dead       *prometheus.CounterVec
	cancelled  *prometheus.CounterVec
	expired    *prometheus.CounterVec
	duration   *prometheus.HistogramVec

	// succeededBy caches, per kind and queue, the series every successful
	// attempt updates (label lookups hash the values and take a lock).
	succeededBy sync.Map // kindQueue -> *succeededSeries
}

type kindQueue struct{ kind, queue string }

// succeededSeries are the series of one kind and queue that a successful
// attempt updates.
type succeededSeries struct {
	duration             prometheus.Observer
	processed, succeeded prometheus.Counter
}

func (w *Worker) succeededSeries(kind, queue string) *succeededSeries {
	k := kindQueue{kind, queue}
	if s, ok := w.succeededBy.Load(k); ok {
		return s.(*succeededSeries)
	}
	s, _ := w.succeededBy.LoadOrStore(k, &succeededSeries{
		duration:  w.duration.WithLabelValues(kind),
		processed: w.processed.WithLabelValues(kind, queue),
		succeeded: w.succeeded.WithLabelValues(kind, queue),
	})
	return s.(*succeededSeries)
}

// Validate reports everything in c that cannot work.
func (c WorkerConfig) Validate() error {
	var errs []error
	if c.Registerer == nil {
		errs = append(errs, errors.New("keel: metrics.WorkerConfig.Registerer is required"))
	}
	for i, k := range c.Kinds {
		if k.Name == "" {
			errs = append(errs, fmt.Errorf("keel: metrics.WorkerConfig.Kinds[%d] has no name", i))
		}
	}
	// Prometheus checks them only when the first duration is observed, and
	// panics then.
	for i := 1; i < len(c.Buckets); i++ {
		if c.Buckets[i] <= c.Buckets[i-1] {
			errs = append(errs, fmt.Errorf("keel: metrics.WorkerConfig.Buckets must be in increasing order, got %v", c.Buckets))
			break
		}
	}
	return errors.Join(errs...)
}

// WithDefaults returns c with each unset field at its default.
func (c WorkerConfig) WithDefaults() WorkerConfig {
	if c.Classifier == nil {
		c.Classifier = retry.Default
	}
	if len(c.Buckets) == 0 {
		c.Buckets = DurationBuckets
	}
	return c
}

// NewWorker creates a worker's metrics and registers them on
// cfg.Registerer, or returns the error of cfg.Validate.
func NewWorker(cfg WorkerConfig) (*Worker, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.WithDefaults()
	w := &Worker{
		classifier: cfg.Classifier,
		processed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "keel_jobs_processed_total",
			Help: "Job attempts that ran to the end, succeeded or failed.",
		}, []string{"kind", "queue"}),
		succeeded: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "keel_jobs_succeeded_total",
			Help: "Job attempts that succeeded.",
		}, []string{"kind", "queue"}),
		failed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "keel_jobs_failed_total",
			Help: "Job attempts that failed, by error class (permanent, transient, unknown).",
		}, []string{"kind", "queue", "class"}),
		postponed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "keel_jobs_postponed_total",
			Help: "Job attempts that could not start yet (a wait: rate limit, busy lease); not failures.",
		}, []string{"kind", "queue"}),
		dead: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "keel_jobs_dead_total",
			Help: "Jobs moved to the dead letters, by error class.",
		}, []string{"kind", "queue", "class"}),
		cancelled: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "keel_jobs_cancelled_total",
			Help: "Running jobs this worker stopped because they were cancelled (a job cancelled while it waited never reaches a worker: see the ledger).",
		}, []string{"kind"}),
		expired: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "keel_jobs_expired_total",
			Help: "Jobs discarded because their deadline passed before they could run, their kind dropping stale work (tasks.ExpireAtDeadline); those that died at their deadline count in keel_jobs_dead_total{class=\"deadline\"}.",
		}, []string{"kind", "queue"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "keel_job_duration_seconds",
			Help:    "How long job attempts took in the handler.",
			Buckets: cfg.Buckets,
		}, []string{"kind"}),
	}
	for _, k := range cfg.Kinds {
		queue := k.Queue
		if queue == "" {
			queue = tasks.DefaultQueue
		}
		for _, v := range []*prometheus.CounterVec{w.processed, w.succeeded, w.postponed, w.expired} {
			v.WithLabelValues(k.Name, queue)
		}
		w.cancelled.WithLabelValues(k.Name)
		for _, c := range retry.StoredClasses() {
			w.failed.WithLabelValues(k.Name, queue, string(c))
			w.dead.WithLabelValues(k.Name, queue, string(c))
		}
	}
	cs := []prometheus.Collector{w.processed, w.succeeded, w.failed, w.postponed, w.dead, w.cancelled, w.expired, w.duration}
	if cfg.DuplicatesSkipped != nil {
		fn := cfg.DuplicatesSkipped
		cs = append(cs, prometheus.NewCounterFunc(prometheus.CounterOpts{
			Name: "keel_duplicate_deliveries_skipped_total",
			Help: "Deliveries of already finished jobs acknowledged without running the handler.",
		}, func() float64 { return float64(fn()) }))
	}
	if cfg.Guard != nil {
		gs := cfg.Guard
		for _, m := range []struct {
			name, help string
			read       func(server.GuardStats) uint64
		}{
			{"keel_handlers_overran_total", "Handlers that outlived their deadline and grace; their attempts counted as failed (class timeout).",
				func(s server.GuardStats) uint64 { return s.Overran }},
			{"keel_runs_interrupted_total", "Runs cut short by a worker's shutdown; released without using an attempt.",
				func(s server.GuardStats) uint64 { return s.Interrupted }},
			{"keel_poison_jobs_retired_total", "Jobs retired because their runs kept ending without an outcome (class crashed).",
				func(s server.GuardStats) uint64 { return s.Crashed }},
		} {
			read := m.read
			cs = append(cs, prometheus.NewCounterFunc(prometheus.CounterOpts{Name: m.name, Help: m.help},
				func() float64 { return float64(read(gs())) }))
		}
		cs = append(cs, prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "keel_handlers_hung",
			Help: "Handlers keel gave up (timed out, cancelled, interrupted) that still run, ignoring their context; only a restart of the worker ends one that never returns."},
			func() float64 { return float64(gs().HungHandlers) }))
	}
	for _, c := range cs {
		if err := cfg.Registerer.Register(c); err != nil {
			return nil, err
		}
	}
	return w, nil
}

// Middleware counts and times every attempt. Install it innermost (in
// server.Config.Middleware) so that it measures the handler itself, and
// deliveries the ledger acknowledges without running anything are not
// counted as processed. A run stopped because its job was cancelled, or cut
// short by the worker's shutdown, is timed but counted neither processed
// nor failed (OnCancelled and keel_runs_interrupted_total count them).
func (w *Worker) Middleware(next asynq.Handler) asynq.Handler {
	return asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
		start := time.Now()
		err := next.ProcessTask(ctx, t)
		kind := t.Type()
		queue, _ := asynq.GetQueueName(ctx)
		s := w.succeededSeries(kind, queue)
		s.duration.Observe(time.Since(start).Seconds())
		if err == nil {
			s.processed.Inc()
			s.succeeded.Inc()
			return nil
		}
		if errors.Is(err, idempotency.ErrCancelled) || errors.Is(context.Cause(ctx), idempotency.ErrCancelled) {
			return err // stopped by a cancel, not a failure: counted by OnCancelled
		}
		if idempotency.Interrupted(ctx) {
			return err // cut short by a deploy, not a failure: keel_runs_interrupted_total
		}
		class := w.classifier.Classify(err)
		if class == retry.ClassWait {
			w.postponed.WithLabelValues(kind, queue).Inc()
			return err
		}
		s.processed.Inc()
		w.failed.WithLabelValues(kind, queue, string(class)).Inc()
		return err
	})
}

// OnDead counts a job that has just died. It has the shape of
// server.GuardConfig.OnDead; call it from there (chain it with any
// other hook).
func (w *Worker) OnDead(_ context.Context, e idempotency.DeadEvent) {
	w.dead.WithLabelValues(e.Kind, e.Queue, e.Class).Inc()
}

// OnExpired counts a job discarded at its deadline before it could run. It
// has the shape of server.GuardConfig.OnExpired.
func (w *Worker) OnExpired(_ context.Context, e idempotency.DeadEvent) {
	w.expired.WithLabelValues(e.Kind, e.Queue).Inc()
}

// OnCancelled counts a running job the guard stopped because it was
// cancelled. It has the shape of server.GuardConfig.OnCancelled.
func (w *Worker) OnCancelled(_ context.Context, e idempotency.CancelEvent) {
	w.cancelled.WithLabelValues(e.Kind).Inc()
}
