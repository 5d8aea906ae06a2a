package cli

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/spf13/cobra"

	"github.com/keeljobs/keel/alert"
	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/metrics"
	"github.com/keeljobs/keel/outbox"
	"github.com/keeljobs/keel/server"
	"github.com/keeljobs/keel/tasks"
)

// observeFlags wire a worker's metrics and death alerts.
type observeFlags struct {
	metricsAddr  string
	alertWebhook string
}

func (o *observeFlags) bind(cmd *cobra.Command) {
	f := cmd.Flags()
	f.StringVar(&o.metricsAddr, "metrics-addr", os.Getenv("KEEL_METRICS_ADDR"),
		"serve this worker's Prometheus metrics on this address, e.g. 127.0.0.1:9464; no auth, bind it privately (env KEEL_METRICS_ADDR)")
	f.StringVar(&o.alertWebhook, "alert-webhook", os.Getenv("KEEL_ALERT_WEBHOOK"),
		"POST a JSON summary of dying jobs here (Slack-compatible; env KEEL_ALERT_WEBHOOK)")
	// A webhook's URL is its credential.
	hideDefault(cmd, "alert-webhook", "KEEL_ALERT_WEBHOOK")
}

// Observer is a worker's metrics registry and alerter.
type Observer struct {
	reg     *prometheus.Registry
	alerter *alert.Alerter
	addr    string
	srv     *server.Server
	mu      sync.Mutex
}

// Observe adds a worker's metrics (registered in reg, a new registry when
// nil; the program's kinds' series exist from the start) and death alerts
// (logged, no webhook; by cfg.Logger when set, as the worker's other
// lines are) to cfg, for a program's own subcommands that run a worker.
// Attach the server, then Run.
func (e *Env) Observe(cfg *server.Config, reg *prometheus.Registry) (*Observer, error) {
	log := cfg.Logger
	if log == nil {
		log = e.Logger()
	}
	return (&observeFlags{}).wire(cfg, reg, log, e.app.Kinds)
}

// wire adds worker metrics and the death alert hook to cfg. reg may be a
// registry another component (the dashboard) already serves.
func (o *observeFlags) wire(cfg *server.Config, reg *prometheus.Registry, log *slog.Logger, kinds *tasks.Kinds) (*Observer, error) {
	ob := &Observer{reg: reg, addr: o.metricsAddr}
	if ob.reg == nil {
		ob.reg = prometheus.NewRegistry()
		ob.reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	}
	var declared []metrics.Kind
	for _, k := range kinds.All() {
		declared = append(declared, metrics.Kind{Name: k.Name(), Queue: k.Queue()})
	}
	wm, err := metrics.NewWorker(metrics.WorkerConfig{Registerer: ob.reg, Classifier: cfg.Classifier, Kinds: declared,
		DuplicatesSkipped: func() uint64 {
			ob.mu.Lock()
			defer ob.mu.Unlock()
			if ob.srv == nil {
				return 0
			}
			return ob.srv.GuardStats().DuplicatesSkipped
		},
		Guard: func() server.GuardStats {
			ob.mu.Lock()
			defer ob.mu.Unlock()
			if ob.srv == nil {
				return server.GuardStats{}
			}
			return ob.srv.GuardStats()
		}})
	if err != nil {
		return nil, err
	}
	stat := func(read func(*server.Server) uint64) func() uint64 {
		return func() uint64 {
			ob.mu.Lock()
			defer ob.mu.Unlock()
			if ob.srv == nil {
				return 0
			}
			return read(ob.srv)
		}
	}
	err = metrics.RegisterOutbox(ob.reg, metrics.OutboxOptions{
		Published: stat(func(s *server.Server) uint64 {
			if s.Relay() == nil {
				return 0
			}
			return s.Relay().Published()
		}),
		Republished:    stat(func(s *server.Server) uint64 { return reconStats(s).Republished }),
		TakenOver:      stat(func(s *server.Server) uint64 { return reconStats(s).TakenOver }),
		LeasesReleased: stat(func(s *server.Server) uint64 { return reconStats(s).LeasesReleased }),
		Pruned:         stat(func(s *server.Server) uint64 { return reconStats(s).Pruned }),
		PrunedBatches:  stat(func(s *server.Server) uint64 { return reconStats(s).PrunedBatches }),
		OwedAlerts:     stat(func(s *server.Server) uint64 { return reconStats(s).OwedAlerts }),
		PrunedByKind: func() map[outbox.KindStatus]uint64 {
			ob.mu.Lock()
			defer ob.mu.Unlock()
			if ob.srv == nil || ob.srv.Reconciler() == nil {
				return nil
			}
			return ob.srv.Reconciler().PrunedByKind()
		},
		DeadLettersToDrop: func() map[string]int {
			ob.mu.Lock()
			defer ob.mu.Unlock()
			if ob.srv == nil || ob.srv.Reconciler() == nil {
				return nil
			}
			return ob.srv.Reconciler().DeadLettersToDrop()
		},
	})
	if err != nil {
		return nil, err
	}
	// The worker metrics already count deaths; the alerter's own counter goes
	// to a registry nobody serves so that deaths are not counted twice.
	ob.alerter, err = alert.New(alert.Config{WebhookURL: o.alertWebhook, Logger: log, Registerer: prometheus.NewRegistry()})
	if err != nil {
		return nil, usageError{fmt.Errorf("--alert-webhook: %w", err)}
	}
	cfg.Middleware = append(cfg.Middleware, wm.Middleware)
	prevCancelled := cfg.Guard.OnCancelled
	cfg.Guard.OnCancelled = func(ctx context.Context, e idempotency.CancelEvent) {
		wm.OnCancelled(ctx, e)
		if prevCancelled != nil {
			prevCancelled(ctx, e)
		}
	}
	prevExpired := cfg.Guard.OnExpired
	cfg.Guard.OnExpired = func(ctx context.Context, e idempotency.DeadEvent) {
		wm.OnExpired(ctx, e)
		if prevExpired != nil {
			prevExpired(ctx, e)
		}
	}
	prev := cfg.Guard.OnDead
	cfg.Guard.OnDead = func(ctx context.Context, e idempotency.DeadEvent) {
		wm.OnDead(ctx, e)
		ob.alerter.JobDied(ctx, e)
		if prev != nil {
			prev(ctx, e)
		}
	}
	return ob, nil
}

func reconStats(s *server.Server) outbox.ReconcileStats {
	if s.Reconciler() == nil {
		return outbox.ReconcileStats{}
	}
	return s.Reconciler().Stats()
}

// Attach tells the observer which server's guard to read.
func (ob *Observer) Attach(srv *server.Server) {
	ob.mu.Lock()
	ob.srv = srv
	ob.mu.Unlock()
}

// Run serves metrics (when an address is set) and sends alerts until ctx
// ends.
func (ob *Observer) Run(ctx context.Context, wg *sync.WaitGroup) error {
	wg.Go(func() { _ = ob.alerter.Run(ctx) })
	if ob.addr == "" {
		return nil
	}
	ln, err := net.Listen("tcp", ob.addr)
	if err != nil {
		return fmt.Errorf("--metrics-addr %s: %w", ob.addr, err)
	}
	hs := &http.Server{Handler: promhttp.HandlerFor(ob.reg, promhttp.HandlerOpts{}), ReadHeaderTimeout: 5 * time.Second}
	wg.Go(func() {
		if err := hs.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			slog.Default().Warn("keel: metrics server stopped", "err", err)
		}
	})
	wg.Go(func() {
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = hs.Shutdown(sctx)
	})
	return nil
}
