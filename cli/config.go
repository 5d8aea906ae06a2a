package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/spf13/cobra"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/redisurl"
	"github.com/keeljobs/keel/outbox"
	"github.com/keeljobs/keel/server"
)

// Defaults for the local machine: the README's commands work without any
// environment set.
const (
	defaultRedisURL    = "redis://127.0.0.1:6379/0"
	defaultDatabaseURL = "postgres://postgres@127.0.0.1:5432/keel?sslmode=disable"
)

// conn holds the connection flags every subcommand shares.
type conn struct {
	redisURL    string
	databaseURL string
	logLevel    string
	logFormat   string
}

func (c *conn) bind(cmd *cobra.Command) {
	f := cmd.PersistentFlags()
	f.StringVar(&c.redisURL, "redis-url", envOr("REDIS_URL", defaultRedisURL),
		"Redis: redis://, rediss://, redis-socket://, redis-sentinel://h1,h2?master=NAME or redis-cluster://h1,h2 (env REDIS_URL)")
	f.StringVar(&c.databaseURL, "database-url", envOr("DATABASE_URL", defaultDatabaseURL), "Postgres URL of the ledger (env DATABASE_URL)")
	f.StringVar(&c.logLevel, "log-level", envOr("KEEL_LOG_LEVEL", "info"), "debug, info, warn or error (env KEEL_LOG_LEVEL)")
	f.StringVar(&c.logFormat, "log-format", envOr("KEEL_LOG_FORMAT", "text"), "text or json (env KEEL_LOG_FORMAT)")
}

func envOr(name, def string) string {
	if v, ok := os.LookupEnv(name); ok && v != "" {
		return v
	}
	return def
}

func envInt(name string, def int) int {
	if v, ok := os.LookupEnv(name); ok && v != "" {
		if n, err := strconv.Atoi(v); err == nil {
			return n
		}
		// Reported by validation below: an unparsable value must not be
		// silently replaced by the default.
		return -1 << 31
	}
	return def
}

func envDuration(name string, def time.Duration) time.Duration {
	if v, ok := os.LookupEnv(name); ok && v != "" {
		if d, err := time.ParseDuration(v); err == nil {
			return d
		}
		return -1
	}
	return def
}

func (c *conn) logger() (*slog.Logger, error) {
	var lvl slog.Level
	if err := lvl.UnmarshalText([]byte(c.logLevel)); err != nil {
		return nil, usageError{fmt.Errorf("--log-level %q: want debug, info, warn or error", c.logLevel)}
	}
	opts := &slog.HandlerOptions{Level: lvl}
	switch strings.ToLower(c.logFormat) {
	case "text":
		return slog.New(slog.NewTextHandler(os.Stderr, opts)), nil
	case "json":
		return slog.New(slog.NewJSONHandler(os.Stderr, opts)), nil
	}
	return nil, usageError{fmt.Errorf("--log-format %q: want text or json", c.logFormat)}
}

func (c *conn) redis() (asynq.RedisConnOpt, error) {
	opt, err := redisurl.Parse(c.redisURL)
	if err != nil {
		return nil, usageError{err}
	}
	return opt, nil
}

// createDatabase creates the database DATABASE_URL names when it does not
// exist yet (migrate and demo call it, so a fresh machine needs no psql).
func (c *conn) createDatabase(ctx context.Context) error {
	cfg, err := pgx.ParseConfig(c.databaseURL)
	if err != nil {
		return usageError{fmt.Errorf("DATABASE_URL %q: %v", redisurl.Redact(c.databaseURL), err)}
	}
	name := cfg.Database
	cfg.Database = "postgres"
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return fmt.Errorf("Postgres at %s is not answering: %w", redisurl.Redact(c.databaseURL), err)
	}
	defer conn.Close(ctx)
	var exists bool
	if err := conn.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)`, name).Scan(&exists); err != nil || exists {
		return err
	}
	_, err = conn.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize())
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "42P04" { // created meanwhile by another process
		return nil
	}
	return err
}

func (c *conn) pool(ctx context.Context) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(c.databaseURL)
	if err != nil {
		return nil, usageError{fmt.Errorf("DATABASE_URL %q: %v", redisurl.Redact(c.databaseURL), err)}
	}
	// search_path in the URL selects the ledger's schema.
	if sp := cfg.ConnConfig.RuntimeParams["search_path"]; sp == "" {
		delete(cfg.ConnConfig.RuntimeParams, "search_path")
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, err
	}
	pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := pool.Ping(pctx); err != nil {
		pool.Close()
		return nil, fmt.Errorf("Postgres at %s is not answering: %w", redisurl.Redact(c.databaseURL), err)
	}
	return pool, nil
}

// workerFlags are the worker's own settings.
type workerFlags struct {
	queues          string
	concurrency     int
	shutdownTimeout time.Duration
	strict          bool
	noRelay         bool
	noReconciler    bool
	retention       time.Duration
	reconcile       reconcileFlags
}

// reconcileFlags are the reconciler's settings, the same on every
// subcommand that runs one (worker, relay).
type reconcileFlags struct {
	interval, grace time.Duration
}

func (r *reconcileFlags) bind(cmd *cobra.Command) {
	f := cmd.Flags()
	f.DurationVar(&r.interval, "reconcile-interval", envDuration("KEEL_RECONCILE_INTERVAL", outbox.DefaultReconcileInterval),
		"time between reconcile passes, which publish again jobs Redis lost (env KEEL_RECONCILE_INTERVAL)")
	f.DurationVar(&r.grace, "reconcile-grace", envDuration("KEEL_RECONCILE_GRACE", outbox.DefaultGrace),
		"how long an open job may be missing from Redis before it counts as lost (env KEEL_RECONCILE_GRACE)")
}

// apply checks the settings and writes them into c.
func (r reconcileFlags) apply(c *outbox.ReconcilerConfig) error {
	if r.interval <= 0 {
		return usageError{fmt.Errorf("--reconcile-interval / KEEL_RECONCILE_INTERVAL must be a positive duration like 5s")}
	}
	if r.grace <= 0 {
		return usageError{fmt.Errorf("--reconcile-grace / KEEL_RECONCILE_GRACE must be a positive duration like 10s")}
	}
	c.Interval, c.Grace = r.interval, r.grace
	return nil
}

func (w *workerFlags) bind(cmd *cobra.Command) {
	f := cmd.Flags()
	f.StringVar(&w.queues, "queues", envOr("KEEL_QUEUES", "critical:6,default:3,low:1"), "queues and weights (env KEEL_QUEUES)")
	f.IntVar(&w.concurrency, "concurrency", envInt("KEEL_CONCURRENCY", server.DefaultConcurrency), "jobs run at once (env KEEL_CONCURRENCY)")
	f.DurationVar(&w.shutdownTimeout, "shutdown-timeout", envDuration("KEEL_SHUTDOWN_TIMEOUT", server.DefaultShutdownTimeout),
		"time running jobs get to finish on SIGTERM (env KEEL_SHUTDOWN_TIMEOUT)")
	f.BoolVar(&w.strict, "strict-priority", os.Getenv("KEEL_STRICT_PRIORITY") == "true", "drain higher-weight queues first (env KEEL_STRICT_PRIORITY)")
	f.BoolVar(&w.noRelay, "no-relay", os.Getenv("KEEL_NO_RELAY") == "true", "do not run a relay inside the worker (env KEEL_NO_RELAY)")
	f.BoolVar(&w.noReconciler, "no-reconciler", os.Getenv("KEEL_NO_RECONCILER") == "true",
		"do not run a reconciler/pruner inside the worker (env KEEL_NO_RECONCILER)")
	f.DurationVar(&w.retention, "retention", envDuration("KEEL_RETENTION", outbox.DefaultRetention),
		"keep succeeded/discarded jobs this long; also the business-key dedupe window (env KEEL_RETENTION)")
	w.reconcile.bind(cmd)
}

func (w *workerFlags) config() (server.Config, error) {
	qs, err := server.ParseQueues(w.queues)
	if err != nil {
		return server.Config{}, usageError{err}
	}
	if w.concurrency < 1 {
		return server.Config{}, usageError{fmt.Errorf("--concurrency / KEEL_CONCURRENCY must be a whole number ≥ 1")}
	}
	if w.shutdownTimeout < 0 {
		return server.Config{}, usageError{fmt.Errorf("--shutdown-timeout / KEEL_SHUTDOWN_TIMEOUT must be a duration like 25s")}
	}
	if w.retention < 0 {
		return server.Config{}, usageError{fmt.Errorf("--retention / KEEL_RETENTION must be a duration like 720h")}
	}
	rc := outbox.ReconcilerConfig{Retention: w.retention}
	if err := w.reconcile.apply(&rc); err != nil {
		return server.Config{}, err
	}
	return server.Config{Queues: qs, Concurrency: w.concurrency, ShutdownTimeout: w.shutdownTimeout,
		StrictPriority: w.strict, DisableRelay: w.noRelay, DisableReconciler: w.noReconciler,
		Reconciler: rc}, nil
}

// service is what a long-running subcommand connects to.
type service struct {
	log   *slog.Logger
	redis asynq.RedisConnOpt
	pool  *pgxpool.Pool
}

// openService checks the settings, connects to the ledger and refuses a
// schema this binary does not know. Close the pool when done.
func (c *conn) openService(ctx context.Context) (*service, error) {
	log, err := c.logger()
	if err != nil {
		return nil, err
	}
	redis, err := c.redis()
	if err != nil {
		return nil, err
	}
	pool, err := c.pool(ctx)
	if err != nil {
		return nil, err
	}
	if err := idempotency.CheckSchema(ctx, pool); err != nil {
		pool.Close()
		return nil, err
	}
	return &service{log: log, redis: redis, pool: pool}, nil
}
