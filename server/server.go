package server

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	"go.opentelemetry.io/otel/trace"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/executor"
	"github.com/keeljobs/keel/internal/jobstore"
	"github.com/keeljobs/keel/internal/ledger"
	"github.com/keeljobs/keel/internal/outcome"
	"github.com/keeljobs/keel/internal/redisconn"
	"github.com/keeljobs/keel/internal/wake"
	"github.com/keeljobs/keel/migrate"
	"github.com/keeljobs/keel/outbox"
	"github.com/keeljobs/keel/retry"
	"github.com/keeljobs/keel/tasks"
)

// Defaults of Config.
const (
	DefaultConcurrency     = 20
	DefaultShutdownTimeout = 25 * time.Second
	// asynq's own defaults (1s and 5s) make an idle worker pick a new job up
	// only every 0.5–1.5 s and move due retries every 5 s. An idle poll is a
	// Redis script per queue: polling every 30ms costs about 100 calls a
	// second per idle worker (300 by Redis's count). keel's worker looks
	// twice when its queues empty and then waits for announced work
	// (IdleWait), so a short interval costs an idle worker nothing and
	// starts a job a few milliseconds after it is announced.
	DefaultTaskCheckInterval = 5 * time.Millisecond
	// DefaultPollingTaskCheckInterval is TaskCheckInterval's default for a
	// worker that never waits for announced work (IdleWait < 0).
	DefaultPollingTaskCheckInterval = 30 * time.Millisecond
	DefaultDelayedTaskCheckInterval = time.Second
	// DefaultIdleWait is how long an idle worker waits for announced work
	// before it looks into its queues again (see Config.IdleWait).
	DefaultIdleWait = time.Second
)

// DefaultQueues are the weighted queues a worker reads when none are set:
// critical gets 60% of the fetches, default 30%, low 10%.
func DefaultQueues() map[string]int { return map[string]int{"critical": 6, "default": 3, "low": 1} }

// Config configures a worker.
type Config struct {
	// Redis holds the queues. Required.
	Redis asynq.RedisConnOpt
	// Pool holds the ledger. Required.
	Pool *pgxpool.Pool
	// Queues maps queue names to weights. Default critical:6 default:3 low:1.
	Queues map[string]int
	// StrictPriority drains higher-weight queues first instead of sharing
	// fetches by weight. Default false.
	StrictPriority bool
	// Concurrency is how many jobs run at once. Default 20.
	Concurrency int
	// TaskCheckInterval is how long a worker that found its queues empty
	// waits before it looks again (asynq sleeps a random time between half
	// and one and a half of it); the look after that waits for announced
	// work (IdleWait). Default 5ms; 30ms with IdleWait negative, where it is
	// the idle worker's polling interval: raise it then to save Redis calls
	// where latency matters less.
	TaskCheckInterval time.Duration
	// DelayedTaskCheckInterval is how often due scheduled jobs and retries
	// are moved to their queue. Default 1s.
	DelayedTaskCheckInterval time.Duration
	// IdleWait is how long a worker whose queues were all empty waits for
	// work to be announced before it looks into them again: keel's
	// publishes (Enqueue, the relay, the reconciler) announce theirs, and
	// the worker's own forwarder its due retries and scheduled jobs, so
	// those start as soon as they arrive; work nobody announced (an asynq
	// client's, a task run from asynqmon) starts IdleWait later at most.
	// An idle worker then sends Redis a few commands a second instead of
	// ~300 (internal/wake). Default 1s; negative: poll every
	// TaskCheckInterval, as asynq does.
	IdleWait time.Duration
	// ShutdownTimeout is how long running jobs may take to finish after a
	// stop signal; jobs still running then go back to their queue. Default 25s
	// (inside Kubernetes' default 30s grace period).
	ShutdownTimeout time.Duration
	// Retry is the retry policy (backoff, budgets). Zero value: defaults.
	Retry retry.Policy
	// Classifier classifies errors handlers return. Default retry.Default.
	Classifier *retry.Classifier
	// Kinds are the program's kinds: a dead job of one of them, or of a
	// kind given to tasks.Handle on the mux New gets, keeps its payload
	// summary from the kind's Summary. Default none: a dead job of any other
	// kind keeps the start of its payload.
	Kinds *tasks.Kinds
	// Guard configures the ledger middleware (lease, batch size, hooks).
	Guard GuardConfig
	// Middleware wraps the handler inside keel's own chain (after recovery,
	// logging, the ledger and classification).
	Middleware []func(asynq.Handler) asynq.Handler
	// DisableRelay stops the worker from running a relay of its own. Relays
	// are safe to run in every worker, so the default is to run one.
	DisableRelay bool
	// Relay configures the embedded relay. Its Pool and Redis default to
	// the worker's.
	Relay outbox.RelayConfig
	// DisableReconciler stops the worker from running a reconciler, which
	// republishes jobs Redis lost, hands a crashed worker's jobs back to
	// Redis within seconds (its rescuer) and prunes old ones. Reconcilers are
	// safe to run side by side, so the default is one in every worker; turn
	// it off in every worker and a crash costs asynq's own recovery (a
	// minute or more) again.
	DisableReconciler bool
	// Reconciler configures the embedded reconciler. Its Pool and Redis
	// default to the worker's.
	Reconciler outbox.ReconcilerConfig
	// Logger; default slog.Default().
	Logger *slog.Logger
	// TracerProvider is the default of Guard.TracerProvider,
	// Relay.TracerProvider and Reconciler.TracerProvider: the worker's
	// keel.handle, keel.claim, keel.step, keel.intx and keel.publish spans.
	// Default: the global provider (otel.GetTracerProvider); while that is
	// the no-op, no span is started.
	TracerProvider trace.TracerProvider
}

// WithDefaults returns c with every unset field at its default.
func (c Config) WithDefaults() Config {
	if len(c.Queues) == 0 {
		c.Queues = DefaultQueues()
	}
	if c.Concurrency == 0 {
		c.Concurrency = DefaultConcurrency
	}
	if c.ShutdownTimeout == 0 {
		c.ShutdownTimeout = DefaultShutdownTimeout
	}
	if c.IdleWait == 0 {
		c.IdleWait = DefaultIdleWait
	}
	if c.TaskCheckInterval == 0 {
		c.TaskCheckInterval = DefaultTaskCheckInterval
		if c.IdleWait < 0 {
			c.TaskCheckInterval = DefaultPollingTaskCheckInterval
		}
	}
	if c.DelayedTaskCheckInterval == 0 {
		c.DelayedTaskCheckInterval = DefaultDelayedTaskCheckInterval
	}
	if c.Classifier == nil {
		c.Classifier = retry.Default
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	c.Retry = c.Retry.WithDefaults()
	if c.Guard.Classifier == nil {
		c.Guard.Classifier = c.Classifier
	}
	if c.Guard.Summarize == nil {
		c.Guard.Summarize = c.Kinds.Summarize
	}
	if c.Guard.Logger == nil {
		c.Guard.Logger = c.Logger
	}
	if c.Guard.OnDead == nil {
		// A death is logged at Error level however keel is run; an alerter
		// set here logs the same line itself.
		log := c.Guard.Logger
		c.Guard.OnDead = func(ctx context.Context, e idempotency.DeadEvent) { e.LogDied(ctx, log) }
	}
	c.Relay, c.Reconciler = c.embedded()
	if c.Relay.Logger == nil {
		c.Relay.Logger = c.Logger
	}
	if c.Reconciler.Logger == nil {
		c.Reconciler.Logger = c.Logger
	}
	if c.Reconciler.OnDead == nil {
		// Jobs the reconciler finds past their deadline die with the
		// worker's alerts and counters.
		c.Reconciler.OnDead = c.Guard.OnDead
	}
	if c.Guard.TracerProvider == nil {
		c.Guard.TracerProvider = c.TracerProvider
	}
	if c.Relay.TracerProvider == nil {
		c.Relay.TracerProvider = c.TracerProvider
	}
	if c.Reconciler.TracerProvider == nil {
		c.Reconciler.TracerProvider = c.TracerProvider
	}
	return c
}

// Validate reports the first thing wrong with c.
func (c Config) Validate() error {
	switch {
	case c.Redis == nil:
		return errors.New("keel: server.Config.Redis is required")
	case c.Pool == nil:
		return errors.New("keel: server.Config.Pool is required")
	case c.Concurrency < 1:
		return fmt.Errorf("keel: concurrency must be at least 1, got %d", c.Concurrency)
	case c.TaskCheckInterval < 0 || c.DelayedTaskCheckInterval < 0:
		return fmt.Errorf("keel: task check intervals must not be negative")
	case c.ShutdownTimeout < 0:
		return fmt.Errorf("keel: shutdown timeout must not be negative, got %s", c.ShutdownTimeout)
	}
	for q, w := range c.Queues {
		if err := ledger.ValidateQueue(q); err != nil {
			return fmt.Errorf("keel: bad queue name: %w", err)
		}
		if w < 1 {
			return fmt.Errorf("keel: queue %q has weight %d; weights must be at least 1", q, w)
		}
	}
	// Checked here so that New refuses them before it connects to anything.
	relay, recon := c.embedded()
	if !c.DisableRelay {
		if err := relay.Validate(); err != nil {
			return err
		}
	}
	if !c.DisableReconciler {
		if err := recon.Validate(); err != nil {
			return err
		}
	}
	return c.Retry.Validate()
}

// embedded returns the configs of the embedded relay and reconciler, with
// the worker's Pool and Redis where they name none of their own.
func (c Config) embedded() (outbox.RelayConfig, outbox.ReconcilerConfig) {
	relay, recon := c.Relay, c.Reconciler
	if relay.Pool == nil {
		relay.Pool = c.Pool
	}
	if relay.Redis == nil {
		relay.Redis = c.Redis
	}
	if recon.Pool == nil {
		recon.Pool = c.Pool
	}
	if recon.Redis == nil {
		recon.Redis = c.Redis
	}
	return relay, recon
}

// ParseQueues reads "critical:6,default:3,low:1". A name without a weight
// gets weight 1.
func ParseQueues(s string) (map[string]int, error) {
	qs := map[string]int{}
	for _, part := range strings.Split(s, ",") {
		part = strings.TrimSpace(part)
		if part == "" {
			continue
		}
		name, w, hasW := strings.Cut(part, ":")
		weight := 1
		if hasW {
			n, err := strconv.Atoi(strings.TrimSpace(w))
			if err != nil || n < 1 {
				return nil, fmt.Errorf("keel: queue %q: weight %q is not a whole number ≥ 1", name, w)
			}
			weight = n
		}
		name = strings.TrimSpace(name)
		if name == "" {
			return nil, fmt.Errorf("keel: queue list %q has an empty name", s)
		}
		if _, dup := qs[name]; dup {
			return nil, fmt.Errorf("keel: queue %q listed twice", name)
		}
		qs[name] = weight
	}
	if len(qs) == 0 {
		return nil, fmt.Errorf("keel: queue list %q names no queue", s)
	}
	return qs, nil
}

// FormatQueues is the inverse of ParseQueues, heaviest first.
func FormatQueues(qs map[string]int) string {
	names := make([]string, 0, len(qs))
	for q := range qs {
		names = append(names, q)
	}
	sort.Slice(names, func(i, j int) bool {
		if qs[names[i]] != qs[names[j]] {
			return qs[names[i]] > qs[names[j]]
		}
		return names[i] < names[j]
	})
	parts := make([]string, len(names))
	for i, q := range names {
		parts[i] = fmt.Sprintf("%s:%d", q, qs[q])
	}
	return strings.Join(parts, ",")
}

// Server is a keel worker: an asynq.Server with keel's middleware chain, the
// ledger guard and (by default) a relay.
type Server struct {
	cfg   Config
	srv   *asynq.Server
	guard *executor.Guard
	relay *outbox.Relay
	recon *outbox.Reconciler

	closeOnce sync.Once
	rc        redis.UniversalClient // the asynq server's; closed by close
	waiter    *wake.Waiter          // holds an idle worker's looks; nil with IdleWait < 0
	h         asynq.Handler
}

// New assembles a worker that runs h (usually a *tasks.Mux).
func New(cfg Config, h asynq.Handler) (*Server, error) {
	if m, ok := h.(*tasks.Mux); ok {
		// A kind's Summary redacts its dead letters wherever it is handled.
		kinds, err := cfg.Kinds.With(m.Declared().All()...)
		if err != nil {
			return nil, fmt.Errorf("keel: server.Config.Kinds and the mux: %w", err)
		}
		cfg.Kinds = kinds
	}
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if h == nil {
		return nil, errors.New("keel: server.New needs a handler")
	}
	cfg.Redis = redisconn.Follow(cfg.Redis)
	// The server's Redis client is made here, not by asynq.NewServer, so that
	// Run can close it when it fails before asynq has started (asynq closes
	// its own client only in Shutdown, which does nothing before Start).
	rc, ok := cfg.Redis.MakeRedisClient().(redis.UniversalClient)
	if !ok {
		return nil, fmt.Errorf("keel: unsupported server.Config.Redis type %T", cfg.Redis)
	}
	s := &Server{cfg: cfg, rc: rc}
	if cfg.IdleWait > 0 {
		s.waiter = wake.New(cfg.IdleWait, cfg.TaskCheckInterval)
		rc.AddHook(s.waiter)
	}
	s.guard = executor.NewGuard(jobstore.NewStore(cfg.Pool), cfg.Guard)
	// asynq fails a delivery past its deadline before any middleware runs;
	// the guard hears of it here and ends the job in the ledger.
	s.srv = asynq.NewServerFromRedisClient(rc, asynq.Config{
		Concurrency:              cfg.Concurrency,
		Queues:                   cfg.Queues,
		StrictPriority:           cfg.StrictPriority,
		ShutdownTimeout:          cfg.ShutdownTimeout,
		TaskCheckInterval:        cfg.TaskCheckInterval,
		DelayedTaskCheckInterval: cfg.DelayedTaskCheckInterval,
		RetryDelayFunc:           cfg.Retry.RetryDelayFunc(),
		IsFailure:                retry.IsFailure,
		ErrorHandler:             asynq.ErrorHandlerFunc(s.guard.HandleError),
		Logger:                   asynqLogger{cfg.Logger},
		LogLevel:                 asynq.WarnLevel,
	})

	chain := []func(asynq.Handler) asynq.Handler{
		Recover(cfg.Logger),
		Log(cfg.Logger),
		s.guard.Middleware,
		cfg.Retry.Middleware(cfg.Classifier),
		// Handler panics must become errors inside the guard: a panic that
		// unwound through it would leave the job running under a lease the
		// guard keeps renewing, and the job would never fail, die or finish.
		Recover(cfg.Logger),
	}
	chain = append(chain, cfg.Middleware...)
	for i := len(chain) - 1; i >= 0; i-- {
		h = chain[i](h)
	}
	s.h = h
	var err error
	if !cfg.DisableRelay {
		if s.relay, err = outbox.NewRelay(cfg.Relay); err != nil {
			s.close()
			return nil, err
		}
	}
	if !cfg.DisableReconciler {
		if s.recon, err = outbox.NewReconciler(cfg.Reconciler); err != nil {
			s.close()
			return nil, err
		}
	}
	return s, nil
}

// GuardStats counts what this worker's ledger guard did to runs.
func (s *Server) GuardStats() GuardStats { return s.guard.Stats() }

// IdleWaits counts the times this worker, its queues empty, waited for
// announced work instead of polling (Config.IdleWait).
func (s *Server) IdleWaits() uint64 {
	if s.waiter == nil {
		return 0
	}
	return s.waiter.Waits()
}

// Relay is the server's embedded relay; nil with DisableRelay.
func (s *Server) Relay() *outbox.Relay { return s.relay }

// Reconciler is the server's embedded reconciler; nil with DisableReconciler.
func (s *Server) Reconciler() *outbox.Reconciler { return s.recon }

// Run processes jobs until ctx ends, then shuts down gracefully: it stops
// fetching, gives running jobs ShutdownTimeout to finish and returns the rest
// to their queues, so nothing is lost. Cancel ctx on SIGTERM/SIGINT
// (signal.NotifyContext).
func (s *Server) Run(ctx context.Context) error {
	if err := migrate.Check(ctx, s.cfg.Pool); err != nil {
		s.close()
		if ctx.Err() != nil {
			return nil // stopped before it started: nothing ran, nothing failed
		}
		return err
	}
	s.declareRetention(ctx)
	if err := s.srv.Start(s.h); err != nil {
		s.close()
		return fmt.Errorf("keel: start worker: %w", err)
	}
	var bg sync.WaitGroup
	bgCtx, stopBackground := context.WithCancel(context.Background())
	if s.relay != nil {
		bg.Go(func() { _ = s.relay.Run(bgCtx) })
	}
	if s.recon != nil {
		bg.Go(func() { _ = s.recon.Run(bgCtx) })
	}
	if s.waiter != nil {
		bg.Go(func() { wake.Listen(bgCtx, s.rc, s.waiter) })
	}
	if have, want := int(s.cfg.Pool.Config().MaxConns), PoolSize(s.cfg.Concurrency); have < want {
		s.cfg.Logger.Warn("keel: the Postgres pool is smaller than this worker's concurrency needs: each InTx and Step holds a connection "+
			"while it runs, and the guard's rounds and renewals need theirs, so jobs will wait for connections "+
			"(set pool_max_conns in the database URL, or lower the concurrency)",
			"pool_max_conns", have, "concurrency", s.cfg.Concurrency, "suggested_pool_max_conns", want)
	}
	s.cfg.Logger.Info("keel worker started", "queues", FormatQueues(s.cfg.Queues),
		"concurrency", s.cfg.Concurrency, "strict_priority", s.cfg.StrictPriority, "holder", s.guard.Holder(),
		"relay", s.relay != nil, "reconciler", s.recon != nil)
	<-ctx.Done()
	s.cfg.Logger.Info("keel worker stopping", "shutdown_timeout", s.cfg.ShutdownTimeout)
	// Runs the deploy cuts short must not count as attempts.
	s.guard.BeginShutdown()
	if s.waiter != nil {
		s.waiter.Close() // asynq's processor must not wait to stop
	}
	s.srv.Shutdown()
	stopBackground()
	bg.Wait()
	s.close()
	s.cfg.Logger.Info("keel worker stopped")
	return nil
}

// PoolSize is the Postgres pool a worker of the given concurrency needs
// for no job to wait for a connection: one per running handler (an InTx or
// a Step holds it) and a few for the guard's rounds and renewals, the relay
// and the reconciler. Run warns when the pool is smaller.
func PoolSize(concurrency int) int { return concurrency + 4 }

// Close releases what New acquired. Run closes the server itself; call
// Close only for a server that is never run.
func (s *Server) Close() { s.close() }

func (s *Server) close() {
	s.closeOnce.Do(s.closeNow)
}

func (s *Server) closeNow() {
	s.guard.Close()
	_ = s.rc.Close()
	if s.relay != nil {
		_ = s.relay.Close()
	}
	if s.recon != nil {
		_ = s.recon.Close()
	}
}

// Recover turns a handler panic into an error (with the stack in the log), so
// one bad job cannot take the worker down.
func Recover(log *slog.Logger) func(asynq.Handler) asynq.Handler {
	return func(next asynq.Handler) asynq.Handler {
		return asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) (err error) {
			defer func() {
				if r := recover(); r != nil {
					log.Error("keel: handler panicked", "kind", t.Type(), "panic", r, "stack", string(debug.Stack()))
					err = fmt.Errorf("keel: handler panicked: %v", r)
				}
			}()
			return next.ProcessTask(ctx, t)
		})
	}
}

// Log writes one structured line per attempt with the task id, kind,
// business key, queue, attempt and duration. Its message says what keel did
// with the delivery: done (at Debug), postponed, failed, or, where the guard says so
// (outcome.With), a duplicate delivery acknowledged, a job
// cancelled, interrupted by shutdown or given up.
func Log(log *slog.Logger) func(asynq.Handler) asynq.Handler {
	return func(next asynq.Handler) asynq.Handler {
		return asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
			start := time.Now()
			id, _ := asynq.GetTaskID(ctx)
			q, _ := asynq.GetQueueName(ctx)
			retried, _ := asynq.GetRetryCount(ctx)
			ctx, noted := outcome.With(ctx)
			err := next.ProcessTask(ctx, t)
			// What the guard did, where the handler's error does not say it;
			// else what the error says. The line's attributes are built only
			// when its level is logged: most workers do not log at Info.
			level, msg, withErr := slog.LevelInfo, "", true
			var extra []any
			switch noted() {
			case outcome.Duplicate:
				msg, withErr = "keel: duplicate delivery acknowledged", false
			case outcome.Cancelled:
				msg = "keel: job cancelled"
			case outcome.Interrupted:
				msg = "keel: job interrupted by shutdown"
			case outcome.GivenUp:
				level, msg = slog.LevelWarn, "keel: job given up"
			case outcome.Held:
				msg, withErr = "keel: job held: its kind or queue is paused", false
			case outcome.Retired:
				level, msg, withErr = slog.LevelWarn, "keel: job retired as a poison job", false
			default:
				withErr = false
				switch {
				case err == nil:
					// One line per success is noise at any rate worth
					// running keel for; the ledger keeps the record.
					level, msg = slog.LevelDebug, "keel: job done"
				case retry.IsWait(err):
					msg = "keel: job postponed"
					extra = []any{"reason", err.Error()}
				default:
					level, msg = slog.LevelWarn, "keel: job failed"
					extra = []any{"err", err.Error(), "class", string(retry.Classify(err))}
				}
			}
			if !log.Enabled(context.Background(), level) {
				return err
			}
			attrs := []any{"task_id", id, "kind", t.Type(), "business_key", t.Headers()[jobstore.HeaderBusinessKey],
				"queue", q, "attempt", retried + 1, "duration", time.Since(start)}
			if withErr && err != nil {
				attrs = append(attrs, "err", err.Error())
			}
			log.Log(context.Background(), level, msg, append(attrs, extra...)...)
			return err
		})
	}
}

// asynqLogger routes asynq's own log lines into slog.
type asynqLogger struct{ l *slog.Logger }

func (a asynqLogger) Debug(args ...any) { a.l.Debug(fmt.Sprint(args...), "source", "asynq") }
func (a asynqLogger) Info(args ...any)  { a.l.Info(fmt.Sprint(args...), "source", "asynq") }
func (a asynqLogger) Warn(args ...any) {
	msg := fmt.Sprint(args...)
	if strings.HasPrefix(msg, "Retry exhausted for task") {
		// asynq archiving its copy of a job keel has recorded dead (and
		// logged, "keel: job died"): nothing more for a person.
		a.l.Debug(msg, "source", "asynq")
		return
	}
	a.l.Warn(msg, "source", "asynq")
}
func (a asynqLogger) Error(args ...any) { a.l.Error(fmt.Sprint(args...), "source", "asynq") }
func (a asynqLogger) Fatal(args ...any) { a.l.Error(fmt.Sprint(args...), "source", "asynq") }
