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

	"github.com/keeljobs/keel/handlers"
	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/server"
	"github.com/keeljobs/keel/tasks"
)

type demoFlags struct {
	apiAddr, mailAddr string
	rate              float64
	duration          time.Duration
	faults            bool
	seed              uint64
}

func demoCmd(c *conn) *cobra.Command {
	d := &demoFlags{}
	w := &workerFlags{}
	cmd := &cobra.Command{
		Use:   "demo",
		Short: "Run the whole stack in one process: worker, relay, scheduler, dashboard, the example order API and a flaky mail service, with traffic",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return runDemo(cmd, c, w, d)
		},
	}
	f := cmd.Flags()
	f.StringVar(&d.apiAddr, "api-addr", "127.0.0.1:8081", "order API listen address")
	f.StringVar(&d.mailAddr, "mail-addr", "127.0.0.1:8025", "simulated mail service listen address")
	f.Float64Var(&d.rate, "rate", 5, "orders per second the traffic generator submits (0: none)")
	f.DurationVar(&d.duration, "duration", 0, "stop after this long (0: run until Ctrl-C)")
	f.BoolVar(&d.faults, "faults", true, "make the mail service misbehave (5xx, 429, timeouts, lost replies, bounces)")
	f.Uint64Var(&d.seed, "seed", 1, "seed of the traffic and fault generator")
	w.bind(cmd)
	addDemoFlags(cmd)
	return cmd
}

// demoComponents are extra parts started by the demo (the dashboard and the
// scheduler register themselves here).
var demoComponents []func(ctx context.Context, env *demoEnv) error

// demoEnv is what the demo's parts share.
type demoEnv struct {
	conn   *conn
	pool   *pgxpool.Pool
	log    *slog.Logger
	out    io.Writer
	client *tasks.Client
	urls   []string
}

func runDemo(cmd *cobra.Command, c *conn, w *workerFlags, d *demoFlags) error {
	cfg, err := w.config()
	if err != nil {
		return err
	}
	log, err := c.logger()
	if err != nil {
		return err
	}
	redis, err := c.redis()
	if err != nil {
		return err
	}
	ctx := cmd.Context()
	if d.duration > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, d.duration)
		defer cancel()
	}
	if err := c.createDatabase(ctx); err != nil {
		return err
	}
	pool, err := c.pool(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	if _, err := idempotency.Migrate(ctx, pool); err != nil {
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
	env := &demoEnv{conn: c, pool: pool, log: log, out: out, client: client}

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
	api := &handlers.API{Pool: pool, Client: client}
	apiURL, err := serve("order API", d.apiAddr, api.Handler())
	if err != nil {
		return err
	}
	env.urls = append(env.urls, "order API      "+apiURL+"/orders   (POST with an Idempotency-Key header; GET /orders/{id})",
		"mail service   "+mailURL+"/stats   (what the flaky external service received)")

	// Short backoff so that retries are visible within a demo minute.
	cfg.Redis, cfg.Pool, cfg.Logger = redis, pool, log
	cfg.Retry.Base, cfg.Retry.Cap = 2*time.Second, 30*time.Second
	mux := tasks.NewMux()
	handlers.Register(mux, handlers.Deps{Pool: pool, Mailer: handlers.HTTPMailer{BaseURL: mailURL,
		Client: &http.Client{Timeout: 3 * time.Second}}})
	srv, err := server.New(cfg, mux)
	if err != nil {
		return usageError{err}
	}
	for _, start := range demoComponents {
		if err := start(ctx, env); err != nil {
			return err
		}
	}
	workerErr := make(chan error, 1)
	go func() { workerErr <- srv.Run(ctx) }()

	fmt.Fprintln(out, "keel demo is running. Ctrl-C stops everything.")
	for _, u := range env.urls {
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
func drive(ctx context.Context, apiURL string, rate float64, seed uint64, log *slog.Logger) {
	rnd := rand.New(rand.NewPCG(seed, 7))
	hc := &http.Client{Timeout: 5 * time.Second}
	t := time.NewTicker(time.Duration(float64(time.Second) / rate))
	defer t.Stop()
	var keys []string
	for n := 0; ; n++ {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		key := fmt.Sprintf("demo-%d-%d", seed, n)
		email := fmt.Sprintf("customer%d@example.com", n)
		switch roll := rnd.Float64(); {
		case roll < 0.10 && len(keys) > 0:
			key = keys[rnd.IntN(len(keys))] // the same order submitted again
		case roll < 0.13:
			email = fmt.Sprintf("customer%d@bounce.example", n)
		}
		keys = append(keys, key)
		body, _ := json.Marshal(handlers.OrderRequest{Email: email, Amount: int64(100 + rnd.IntN(9900))})
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
	counts := map[string]int{}
	rows, err := pool.Query(ctx, `SELECT status, count(*) FROM keel_jobs GROUP BY status`)
	if err != nil {
		return "", err
	}
	for rows.Next() {
		var s string
		var n int
		if err := rows.Scan(&s, &n); err != nil {
			rows.Close()
			return "", err
		}
		counts[s] = n
	}
	rows.Close()
	ms := mail.Stats()
	return fmt.Sprintf("orders %d | jobs: %d succeeded, %d pending, %d running, %d failed (retrying), %d dead, %d discarded | mail: %d calls, %d mails, %d orders mailed twice",
		orders, counts["succeeded"], counts["pending"], counts["running"], counts["failed"], counts["dead"], counts["discarded"],
		ms.Calls, ms.Mails, ms.OrdersMailedTwice), nil
}

func printSummary(ctx context.Context, out io.Writer, pool *pgxpool.Pool, mail *handlers.MailSim) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if line, err := statusLine(ctx, pool, mail); err == nil {
		fmt.Fprintln(out, "final: "+line)
	}
}
