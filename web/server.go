package web

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"time"

	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/redis/go-redis/v9"

	"github.com/keeljobs/keel/inspect"
	"github.com/keeljobs/keel/internal/jobstore"
	"github.com/keeljobs/keel/internal/redisconn"
	"github.com/keeljobs/keel/metrics"
)

// Server is keel's web server: keel's pages, asynqmon under /monitoring/,
// /metrics and /healthz, all behind one sign-in.
type Server struct {
	cfg    Config
	origin string
	store  *jobstore.Store
	insp   *asynq.Inspector
	rdb    redis.UniversalClient // the inspector's connections
	// ops is the operator API every action on jobs goes through: the
	// pages', the bulk ones', asynqmon's.
	ops     *inspect.Inspector
	monRO   *monitor
	monRW   *monitor
	auth    *auth
	sampler *sampler
	reg     *prometheus.Registry
	pages   *pages
	pageCSP string
	hosts   hostPolicy
	handler http.Handler
	bulks   *bulkRuns
	// bulkStarting, when a test sets it, is called with the request's
	// context once a bulk action's form is read, before the jobs are
	// selected.
	bulkStarting func(ctx context.Context)
	// hidesUndeclared: the default PayloadFormatter hides payloads of kinds
	// this program does not declare (see DeclaredPayloads).
	hidesUndeclared bool

	closeOnce sync.Once
}

// New builds a server; Run it, or mount Handler in a server of your own,
// and Close it when done.
func New(cfg Config) (*Server, error) {
	hidesUndeclared := cfg.PayloadFormatter == nil
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	secret := cfg.Secret
	if len(secret) == 0 {
		secret = make([]byte, MinSecretBytes)
		if _, err := rand.Read(secret); err != nil {
			return nil, err
		}
	}
	cfg.Redis = redisconn.Follow(cfg.Redis)
	s := &Server{cfg: cfg, store: jobstore.NewStore(cfg.Pool), auth: newAuth(cfg, secret), bulks: newBulkRuns(),
		hidesUndeclared: hidesUndeclared}
	if cfg.Origin != "" {
		s.origin, _ = parseOrigin(cfg.Origin)
	}
	s.hosts = newHostPolicy(cfg, s.origin)
	var err error
	if s.pages, err = newPages(); err != nil {
		return nil, err
	}
	s.pageCSP = pageCSP(string(s.pages.css))
	if s.monRO, err = newMonitor(cfg.Redis, cfg.PayloadFormatter, true); err != nil {
		return nil, err
	}
	if s.monRW, err = newMonitor(cfg.Redis, cfg.PayloadFormatter, false); err != nil {
		s.monRO.h.Close()
		return nil, err
	}
	// One connection pool for the inspector and the operator API's pauses.
	s.rdb = cfg.Redis.MakeRedisClient().(redis.UniversalClient)
	s.insp = asynq.NewInspectorFromRedisClient(s.rdb)
	if s.ops, err = inspect.New(inspect.Config{Pool: cfg.Pool, Asynq: s.insp, RedisClient: s.rdb}); err != nil {
		return nil, err
	}
	s.reg = cfg.Registry
	if s.reg == nil {
		s.reg = prometheus.NewRegistry()
		s.reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	}
	ledger, err := metrics.NewLedger(metrics.LedgerConfig{Pool: cfg.Pool, Inspector: s.insp, Timeout: cfg.ScrapeTimeout})
	if err == nil {
		err = s.reg.Register(ledger)
	}
	if err != nil {
		s.closeClients()
		return nil, fmt.Errorf("keel web: registering the ledger collector: %w", err)
	}
	if cfg.ProxyUserHeader != "" {
		cfg.Logger.Warn("keel web: trusting the "+cfg.ProxyUserHeader+" header to name signed-in users; "+
			"only the SSO proxy may be able to reach this server, and it must overwrite that header", "addr", cfg.Addr)
	}
	s.sampler = startSampler(s.insp, cfg.SampleInterval, cfg.Logger)
	s.handler = s.routes()
	return s, nil
}

// Handler serves everything the server offers.
func (s *Server) Handler() http.Handler { return s.handler }

// Registry is what /metrics serves.
func (s *Server) Registry() *prometheus.Registry { return s.reg }

func (s *Server) routes() http.Handler {
	app := http.NewServeMux()
	app.HandleFunc("GET /{$}", s.overview)
	app.HandleFunc("GET /dead", s.deadLetters)
	app.HandleFunc("GET /dead/confirm", operatorOnly(s.bulkConfirm))
	app.HandleFunc("POST /dead/bulk", operatorOnly(checkToken(s.bulk)))
	app.HandleFunc("GET /bulk/{id}", s.bulkProgress)
	app.HandleFunc("GET /jobs", s.lookup)
	app.HandleFunc("GET /jobs/{id}", s.job)
	app.HandleFunc("GET /batches", s.batches)
	app.HandleFunc("GET /retention", s.retention)
	app.HandleFunc("GET /batches/{id}", s.batch)
	app.HandleFunc("GET /workflows/{id}", s.workflow)
	app.HandleFunc("GET /schedules", s.schedules)
	app.HandleFunc("POST /schedules/pause", operatorOnly(checkToken(s.scheduleAction(false))))
	app.HandleFunc("POST /schedules/resume", operatorOnly(checkToken(s.scheduleAction(true))))
	app.HandleFunc("GET /keys", s.concurrencyKeys)
	app.HandleFunc("POST /jobs/{id}/replay", operatorOnly(checkToken(s.replay)))
	app.HandleFunc("POST /jobs/{id}/discard", operatorOnly(checkToken(s.discard)))
	app.HandleFunc("POST /jobs/{id}/resolve", operatorOnly(checkToken(s.resolve)))
	app.HandleFunc("POST /jobs/{id}/cancel", operatorOnly(checkToken(s.cancelJob)))
	app.HandleFunc("POST /jobs/{id}/release", operatorOnly(checkToken(s.releaseJob)))
	app.HandleFunc("POST /jobs/{id}/payload", operatorOnly(checkToken(s.showPayload)))
	app.HandleFunc("GET /pauses", s.pauses)
	app.HandleFunc("POST /pauses", operatorOnly(checkToken(s.pauseAction)))
	app.HandleFunc("POST /logout", checkToken(s.logout))
	app.HandleFunc("GET "+MonitoringPath, func(w http.ResponseWriter, r *http.Request) {
		http.Redirect(w, r, MonitoringPath+"/", http.StatusMovedPermanently)
	})
	app.HandleFunc(MonitoringPath+"/", s.monitoring)

	root := http.NewServeMux()
	root.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		_, _ = w.Write([]byte("ok\n"))
	})
	root.HandleFunc("GET /login", s.loginPage)
	root.HandleFunc("POST /login", s.login)
	root.Handle("GET /metrics", s.metricsHandler())
	root.Handle("/", s.requireSignIn(app))
	return s.securityHeaders(s.checkHost(cleanRequest(s.sameOrigin(root))))
}

// requireSignIn lets only signed-in users through. A browser asking for a
// page is sent to the sign-in form; anything else gets 401.
func (s *Server) requireSignIn(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p, err := s.auth.identifyErr(r)
		if err != nil && !safeMethod(r.Method) {
			// Whether the session was signed out is unknown: nothing may
			// change under it. Reads go on (the overview shows Redis's
			// side in a ledger outage).
			http.Error(w, "keel could not check your session against the ledger (Postgres), so it cannot change anything now; the server's log says why ("+
				s.logRef("checking a session failed", r, err)+")", http.StatusServiceUnavailable)
			return
		}
		if p == nil {
			if safeMethod(r.Method) && !strings.HasPrefix(r.URL.Path, MonitoringPath+"/api/") {
				http.Redirect(w, r, "/login?next="+url.QueryEscape(r.URL.RequestURI()), http.StatusFound)
				return
			}
			http.Error(w, "sign in required", http.StatusUnauthorized)
			return
		}
		next.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), principalKey{}, p)))
	})
}

// metricsHandler serves /metrics to Prometheus (with the bearer token), to
// signed-in users, or to anyone when configured public.
func (s *Server) metricsHandler() http.Handler {
	h := promhttp.HandlerFor(s.reg, promhttp.HandlerOpts{})
	var tokenSum [sha256.Size]byte
	if s.cfg.MetricsToken != "" {
		tokenSum = sha256.Sum256([]byte(s.cfg.MetricsToken))
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ok := s.cfg.MetricsPublic || s.auth.identify(r) != nil
		if !ok && s.cfg.MetricsToken != "" {
			if tok, found := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer "); found {
				// Comparing digests keeps the time independent of the token's length.
				got := sha256.Sum256([]byte(strings.TrimSpace(tok)))
				ok = subtle.ConstantTimeCompare(got[:], tokenSum[:]) == 1
			}
		}
		if !ok {
			w.Header().Set("WWW-Authenticate", `Bearer realm="keel metrics"`)
			http.Error(w, "sign in or send the metrics bearer token", http.StatusUnauthorized)
			return
		}
		w.Header().Set("Cache-Control", "no-store")
		h.ServeHTTP(w, r)
	})
}

// Run serves on cfg.Addr until ctx ends, then shuts down gracefully and
// closes the server.
func (s *Server) Run(ctx context.Context) error {
	ln, err := net.Listen("tcp", s.cfg.Addr)
	if err != nil {
		s.Close()
		return fmt.Errorf("keel web: %w", err)
	}
	return s.Serve(ctx, ln)
}

// Serve is Run on a listener of the caller's.
func (s *Server) Serve(ctx context.Context, ln net.Listener) error {
	defer s.Close()
	hs := &http.Server{
		Handler:           s.handler,
		ReadHeaderTimeout: 10 * time.Second,
		ReadTimeout:       30 * time.Second,
		WriteTimeout:      60 * time.Second,
		IdleTimeout:       2 * time.Minute,
	}
	errc := make(chan error, 1)
	go func() {
		if s.cfg.TLSCertFile != "" {
			errc <- hs.ServeTLS(ln, s.cfg.TLSCertFile, s.cfg.TLSKeyFile)
			return
		}
		errc <- hs.Serve(ln)
	}()
	s.cfg.Logger.Info("keel web started", "addr", ln.Addr().String(), "users", len(s.cfg.Users),
		"proxy_header", s.cfg.ProxyUserHeader, "tls", s.cfg.TLSCertFile != "", "metrics_public", s.cfg.MetricsPublic)
	select {
	case err := <-errc:
		return fmt.Errorf("keel web: %w", err)
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	err := hs.Shutdown(sctx)
	if errors.Is(err, context.DeadlineExceeded) {
		err = hs.Close()
	}
	s.cfg.Logger.Info("keel web stopped")
	return err
}

// Close stops sampling and releases the server's Redis connections.
func (s *Server) Close() {
	s.closeOnce.Do(func() {
		s.bulks.close() // before the clients its actions use
		s.sampler.close()
		s.closeClients()
	})
}

func (s *Server) closeClients() {
	_ = s.monRO.h.Close()
	_ = s.monRW.h.Close()
	_ = s.rdb.Close()
}
