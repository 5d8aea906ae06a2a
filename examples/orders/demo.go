package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/spf13/cobra"
	"golang.org/x/crypto/bcrypt"

	"github.com/keeljobs/keel/cli"
	"github.com/keeljobs/keel/handlers"
	"github.com/keeljobs/keel/inspect"
	"github.com/keeljobs/keel/migrate"
	"github.com/keeljobs/keel/scheduler"
	"github.com/keeljobs/keel/server"
	"github.com/keeljobs/keel/tasks"
	"github.com/keeljobs/keel/web"
)

type demoFlags struct {
	apiAddr, mailAddr, webAddr string
	rate                       float64
	duration                   time.Duration
	faults                     bool
	seed                       uint64
}

func demoCmd(env *cli.Env) *cobra.Command {
	d := &demoFlags{}
	w := &cli.WorkerFlags{}
	cmd := &cobra.Command{
		Use:   "demo",
		Short: "Run the whole stack in one process: worker, relay, scheduler, dashboard, the example order API and a flaky mail service, with traffic",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return runDemo(cmd, env, w, d)
		},
	}
	f := cmd.Flags()
	f.StringVar(&d.apiAddr, "api-addr", "127.0.0.1:8081", "order API listen address")
	f.StringVar(&d.mailAddr, "mail-addr", "127.0.0.1:8025", "simulated mail service listen address")
	f.StringVar(&d.webAddr, "web-addr", "127.0.0.1:8080", "dashboard listen address (loopback only: the demo's passwords are public)")
	f.Float64Var(&d.rate, "rate", 5, "orders per second the traffic generator submits (0: none)")
	f.DurationVar(&d.duration, "duration", 0, "stop after this long (0: run until Ctrl-C)")
	f.BoolVar(&d.faults, "faults", true, "make the mail service misbehave (5xx, 429, timeouts, lost replies, bounces)")
	f.Uint64Var(&d.seed, "seed", 1, "seed of the traffic and fault generator")
	w.Bind(cmd)
	return cmd
}

// reportsConcurrency is the long jobs' own worker's.
const reportsConcurrency = 2

// The demo's dashboard users. Their password is printed and public, which
// is why the demo's dashboard only listens on loopback.
const demoPassword = "keel-demo"

func runDemo(cmd *cobra.Command, env *cli.Env, w *cli.WorkerFlags, d *demoFlags) error {
	cfg, err := w.Config()
	if err != nil {
		return err
	}
	cfg.Kinds = handlers.Kinds
	log := env.Logger()
	redis, err := env.Redis(cmd.Context())
	if err != nil {
		return err
	}
	ctx := cmd.Context()
	if d.duration > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, d.duration)
		defer cancel()
	}
	if err := env.CreateDatabase(ctx); err != nil {
		return err
	}
	// One pool for both workers, the order API, the dashboard and the
	// scheduler: each worker's share (server.PoolSize), and a few more.
	pool, err := env.PoolFor(ctx, server.PoolSize(cfg.Concurrency)+server.PoolSize(reportsConcurrency)+4)
	if err != nil {
		return err
	}
	defer pool.Close()
	if _, err := migrate.Up(ctx, pool); err != nil {
		return err
	}
	if err := handlers.Migrate(ctx, pool); err != nil {
		return err
	}
	client, err := tasks.NewClient(tasks.ClientConfig{Redis: redis, Pool: pool, Logger: log})
	if err != nil {
		return err
	}
	defer client.Close()
	out := cmd.OutOrStdout()
	var urls []string

	faults := handlers.Faults{}
	if d.faults {
		faults = handlers.Faults{ServerErrors: 0.05, RateLimited: 0.05, RetryAfter: 2 * time.Second,
			Slow: 0.02, SlowFor: 6 * time.Second, LostReplies: 0.03, BounceDomain: "bounce.example"}
	}
	mail := handlers.NewMailSim(faults, d.seed)
	var wg sync.WaitGroup
	serve := func(name, addr string, h http.Handler) (string, error) {
		l, err := net.Listen("tcp", addr)
		if err != nil {
			return "", fmt.Errorf("%s: listen on %s: %w", name, addr, err)
		}
		srv := &http.Server{Handler: h, ReadHeaderTimeout: 5 * time.Second}
		wg.Go(func() { _ = srv.Serve(l) })
		wg.Go(func() {
			<-ctx.Done()
			sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			_ = srv.Shutdown(sctx)
		})
		return "http://" + l.Addr().String(), nil
	}
	mailURL, err := serve("mail service", d.mailAddr, mail)
	if err != nil {
		return err
	}
	// The mail service's faults are on purpose: Info, not Warn or Error.
	log = demoLogger(log, mailURL)
	api := &handlers.API{Pool: pool, Client: client}
	apiURL, err := serve("order API", d.apiAddr, api.Handler())
	if err != nil {
		return err
	}
	urls = append(urls, "order API      "+apiURL+"/orders   (POST with an Idempotency-Key header; GET /orders/{id})",
		"mail service   "+mailURL+"/stats   (what the flaky external service received)")

	// Short backoff so that retries are visible within a demo minute.
	cfg.Redis, cfg.Pool, cfg.Logger = redis, pool, log
	cfg.Retry.Base, cfg.Retry.Cap = 2*time.Second, 30*time.Second
	mux := tasks.NewMux()
	handlers.Register(mux, handlers.Deps{Pool: pool, Mailer: handlers.HTTPMailer{BaseURL: mailURL,
		Client: &http.Client{Timeout: 3 * time.Second}}})
	// The dashboard, serving the worker's metrics on its /metrics too.
	if !web.IsLoopback(d.webAddr) {
		return cli.UsageError(fmt.Errorf("--web-addr %s: the demo's dashboard passwords are public; it only listens on loopback", d.webAddr))
	}
	users, err := demoUsers()
	if err != nil {
		return err
	}
	dash, err := web.New(web.Config{Addr: d.webAddr, Users: users, Redis: redis, Pool: pool, Logger: log, Kinds: handlers.Kinds})
	if err != nil {
		return err
	}
	ob, err := env.Observe(&cfg, dash.Registry())
	if err != nil {
		return err
	}
	srv, err := server.New(cfg, mux)
	if err != nil {
		return cli.UsageError(err)
	}
	ob.Attach(srv)
	// Long jobs get a worker pool of their own, as docs/configuration.md advises.
	reportsCfg := cfg
	reportsCfg.Queues = map[string]int{handlers.ReportsQueue: 1}
	reportsCfg.Concurrency = reportsConcurrency
	reportsCfg.DisableRelay, reportsCfg.DisableReconciler = true, true
	reports, err := server.New(reportsCfg, mux)
	if err != nil {
		srv.Close()
		return cli.UsageError(err)
	}
	if err := ob.Run(ctx, &wg); err != nil {
		return err
	}
	wg.Go(func() {
		if err := dash.Run(ctx); err != nil && ctx.Err() == nil {
			log.Error("demo: dashboard stopped", "err", err)
		}
	})
	urls = append([]string{"dashboard      http://" + d.webAddr + "/   (operator / " + demoPassword + ", or viewer / " + demoPassword + ")",
		"asynqmon       http://" + d.webAddr + "/monitoring/"}, urls...)

	// The example's cron entries: a report every minute so the demo shows
	// it, and the nightly one.
	sched, err := scheduler.New(scheduler.Config{Client: client, Logger: log, Kinds: handlers.Kinds, Entries: []scheduler.Entry{
		{Name: "demo-report-every-minute", Spec: "@every 1m", Kind: handlers.GenerateDailyReport.Name(), Payload: []byte(`{}`)},
		{Name: "report-daily", Spec: "0 1 * * *", Kind: handlers.GenerateDailyReport.Name(), Payload: []byte(`{}`)},
	}})
	if err != nil {
		return err
	}
	wg.Go(func() { _ = sched.Run(ctx) })

	workerErr := make(chan error, 1)
	go func() { workerErr <- srv.Run(ctx) }()
	wg.Go(func() {
		if err := reports.Run(ctx); err != nil {
			log.Error("demo: reports worker stopped", "err", err)
		}
	})

	fmt.Fprintln(out, "keel demo is running. Ctrl-C stops everything.")
	for _, u := range urls {
		fmt.Fprintln(out, "  "+u)
	}
	fmt.Fprintf(out, "  try: curl -s -XPOST -H 'Idempotency-Key: my-first' -d '{\"email\":\"you@example.com\",\"amount\":42}' %s/orders\n", apiURL)

	if d.rate > 0 {
		wg.Go(func() { drive(ctx, apiURL, d.rate, d.seed, log) })
	}
	wg.Go(func() { report(ctx, out, pool, mail, 10*time.Second) })
	err = <-workerErr
	wg.Wait()
	printSummary(context.Background(), out, pool, mail)
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return nil
	}
	return err
}

// drive submits orders like a real front end would: mostly new, some
// double-submitted, some to addresses that bounce.
func demoUsers() ([]web.User, error) {
	// The cheapest cost: these passwords are printed for anyone to read.
	hash, err := bcrypt.GenerateFromPassword([]byte(demoPassword), bcrypt.MinCost)
	if err != nil {
		return nil, err
	}
	return []web.User{{Name: "operator", Role: web.RoleOperator, PasswordHash: hash},
		{Name: "viewer", Role: web.RoleViewer, PasswordHash: hash}}, nil
}

func drive(ctx context.Context, apiURL string, rate float64, seed uint64, log *slog.Logger) {
	rnd := rand.New(rand.NewPCG(seed, 7))
	hc := &http.Client{Timeout: 5 * time.Second}
	t := time.NewTicker(time.Duration(float64(time.Second) / rate))
	defer t.Stop()
	type submission struct {
		key  string
		body []byte
	}
	var sent []submission
	// Keys unique to this run: a new demo run makes new orders, not
	// duplicates of the last run's.
	run := time.Now().UnixNano()
	for n := 0; ; n++ {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		key := fmt.Sprintf("demo-%d-%d", run, n)
		email := fmt.Sprintf("customer%d@example.com", n)
		var body []byte
		switch roll := rnd.Float64(); {
		case roll < 0.10 && len(sent) > 0:
			// The same order submitted again: its key and its body.
			s := sent[rnd.IntN(len(sent))]
			key, body = s.key, s.body
		case roll < 0.13:
			email = fmt.Sprintf("customer%d@bounce.example", n)
		}
		if body == nil {
			body, _ = json.Marshal(handlers.OrderRequest{Email: email, Amount: int64(100 + rnd.IntN(9900))})
			sent = append(sent, submission{key, body})
		}
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, apiURL+"/orders", bytes.NewReader(body))
		req.Header.Set("Idempotency-Key", key)
		resp, err := hc.Do(req)
		if err != nil {
			if ctx.Err() == nil {
				log.Warn("demo: order submission failed", "err", err)
			}
			continue
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
}

func report(ctx context.Context, out io.Writer, pool *pgxpool.Pool, mail *handlers.MailSim, every time.Duration) {
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			line, err := statusLine(ctx, pool, mail)
			if err == nil {
				fmt.Fprintln(out, line)
			}
		}
	}
}

func statusLine(ctx context.Context, pool *pgxpool.Pool, mail *handlers.MailSim) (string, error) {
	var orders int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM keel_example_orders`).Scan(&orders); err != nil {
		return "", err
	}
	// The demo's reads go through the operator API, as a program's would.
	insp, err := inspect.New(inspect.Config{Pool: pool})
	if err != nil {
		return "", err
	}
	defer insp.Close()
	byKind, err := insp.Counts(ctx)
	if err != nil {
		return "", err
	}
	counts := map[string]int{}
	for _, c := range byKind {
		counts[string(c.Status)] += c.N
	}
	ms := mail.Stats()
	// The ledger's figures include earlier runs; the mail service starts
	// from zero with each run.
	return fmt.Sprintf("ledger, all runs: orders %d | jobs: %d succeeded, %d pending, %d running, %d failed (retrying), %d dead, %d discarded, %d cancelled | mail service, this run: %d calls, %d mails, %d orders mailed twice",
		orders, counts["succeeded"], counts["pending"], counts["running"], counts["failed"], counts["dead"], counts["discarded"], counts["cancelled"],
		ms.Calls, ms.Mails, ms.OrdersMailedTwice), nil
}

func printSummary(ctx context.Context, out io.Writer, pool *pgxpool.Pool, mail *handlers.MailSim) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if line, err := statusLine(ctx, pool, mail); err == nil {
		fmt.Fprintln(out, "final: "+line)
	}
}
