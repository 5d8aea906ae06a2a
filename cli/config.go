package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	"github.com/spf13/cobra"

	"github.com/keeljobs/keel/inspect"
	"github.com/keeljobs/keel/internal/redisconn"
	"github.com/keeljobs/keel/internal/visible"
	"github.com/keeljobs/keel/migrate"
	"github.com/keeljobs/keel/outbox"
	"github.com/keeljobs/keel/redisurl"
	"github.com/keeljobs/keel/server"
	"github.com/keeljobs/keel/tasks"
)

// Defaults for the local machine: the README's commands work without any
// environment set.
const (
	DefaultRedisURL    = "redis://127.0.0.1:6379/0"
	DefaultDatabaseURL = "postgres://postgres@127.0.0.1:5432/keel?sslmode=disable"
)

// Env holds the settings every subcommand shares (connections, logging,
// output) and opens the connections they name. A program's own subcommands
// (App.Commands) get it too.
type Env struct {
	app         App
	redisURL    string
	databaseURL string
	logLevel    string
	logFormat   string
	output      string
	asJSON      bool
	log         *slog.Logger
	// poolConns is the least pool size a command needs (a worker's, for
	// its concurrency); the URL's pool_max_conns, when set, wins.
	poolConns int
	// root is the program's root command: logs go to its error writer
	// (os.Stderr unless the program set another).
	root *cobra.Command
}

func (e *Env) bind(cmd *cobra.Command) {
	e.root = cmd
	f := cmd.PersistentFlags()
	f.StringVar(&e.redisURL, "redis-url", envOr("REDIS_URL", DefaultRedisURL),
		"Redis: redis://, rediss://, redis-socket://, redis-sentinel://h1,h2?master=NAME or redis-cluster://h1,h2 (env REDIS_URL)")
	f.StringVar(&e.databaseURL, "database-url", envOr("DATABASE_URL", DefaultDatabaseURL), "Postgres URL of the ledger (env DATABASE_URL)")
	// Help prints the defaults, which come from the environment.
	for _, name := range []string{"redis-url", "database-url"} {
		fl := f.Lookup(name)
		fl.DefValue = redisurl.Redact(fl.DefValue)
	}
	f.StringVar(&e.logLevel, "log-level", envOr("KEEL_LOG_LEVEL", "info"), "debug, info, warn or error (env KEEL_LOG_LEVEL)")
	f.StringVar(&e.logFormat, "log-format", envOr("KEEL_LOG_FORMAT", "text"), "text or json (env KEEL_LOG_FORMAT)")
	f.StringVarP(&e.output, "output", "o", "text", "what commands print: text or json")
	f.BoolVar(&e.asJSON, "json", false, "print JSON (the same as -o json)")
}

// hideDefault keeps the default of cmd's flag name, a secret taken from the
// environment variable env, out of --help.
func hideDefault(cmd *cobra.Command, name, env string) {
	if fl := cmd.Flags().Lookup(name); fl.DefValue != "" {
		fl.DefValue = "set from " + env + ", not shown"
	}
}

// prepare checks the shared settings before any command runs and routes
// go-redis's own log lines (one per failed dial, many a second while Redis
// is down) to the logger at debug level.
func (e *Env) prepare(cmd *cobra.Command) error {
	if err := badEnv(cmd); err != nil {
		return err
	}
	switch strings.ToLower(e.output) {
	case "text":
		if e.asJSON && cmd.Flags().Changed("output") {
			return usageError{errors.New("--output text and --json disagree: give one")}
		}
	case "json":
		e.asJSON = true
	default:
		return usageError{fmt.Errorf("--output %q: want text or json", e.output)}
	}
	log, err := e.newLogger()
	if err != nil {
		return err
	}
	e.log = log
	if !e.asJSON {
		// Commands print job-supplied text (errors, keys, notes): it must
		// not drive the operator's terminal. JSON is for scripts, as is.
		cmd.SetOut(visible.NewWriter(cmd.OutOrStdout()))
	}
	// Handlers that log through slog's default logger follow the flags too.
	slog.SetDefault(log)
	redis.SetLogger(redisLogger{log})
	return nil
}

// JSON reports whether the user asked for JSON output (--json or -o json).
func (e *Env) JSON() bool { return e.asJSON }

// DatabaseURL is the ledger's Postgres URL (--database-url, DATABASE_URL).
func (e *Env) DatabaseURL() string { return e.databaseURL }

// Logger is the logger --log-level and --log-format describe, writing to
// stderr.
func (e *Env) Logger() *slog.Logger {
	if e.log == nil {
		if log, err := e.newLogger(); err == nil {
			e.log = log
		} else {
			e.log = slog.Default()
		}
	}
	return e.log
}

type redisLogger struct{ log *slog.Logger }

func (r redisLogger) Printf(ctx context.Context, format string, v ...any) {
	r.log.DebugContext(ctx, "go-redis: "+fmt.Sprintf(format, v...))
}

func envOr(name, def string) string {
	if v, ok := os.LookupEnv(name); ok && v != "" {
		return v
	}
	return def
}

const badEnvPrefix = "keel:bad-env:"

// envBool reads a boolean environment variable: true, false, 1, 0, t, f,
// yes, no, on or off, in any case. A value it cannot read is reported when
// cmd runs (badEnv), not silently taken as false: KEEL_WEB_BEHIND_HTTPS=1
// that meant nothing would leave cookies without Secure.
func envBool(cmd *cobra.Command, name string) bool {
	v := strings.TrimSpace(os.Getenv(name))
	switch strings.ToLower(v) {
	case "":
		return false
	case "yes", "on":
		return true
	case "no", "off":
		return false
	}
	b, err := strconv.ParseBool(v)
	if err != nil {
		if cmd.Annotations == nil {
			cmd.Annotations = map[string]string{}
		}
		cmd.Annotations[badEnvPrefix+name] = fmt.Sprintf("%s=%q: want true or false", name, os.Getenv(name))
	}
	return b
}

// badEnv is the usage error for the boolean variables of cmd that envBool
// could not read.
func badEnv(cmd *cobra.Command) error {
	var bad []string
	for k, msg := range cmd.Annotations {
		if strings.HasPrefix(k, badEnvPrefix) {
			bad = append(bad, msg)
		}
	}
	if len(bad) == 0 {
		return nil
	}
	slices.Sort(bad)
	return usageError{errors.New(strings.Join(bad, "; "))}
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

func (e *Env) newLogger() (*slog.Logger, error) {
	var lvl slog.Level
	if err := lvl.UnmarshalText([]byte(e.logLevel)); err != nil {
		return nil, usageError{fmt.Errorf("--log-level %q: want debug, info, warn or error", e.logLevel)}
	}
	opts := &slog.HandlerOptions{Level: lvl}
	var w io.Writer = os.Stderr
	if e.root != nil {
		w = e.root.ErrOrStderr()
	}
	switch strings.ToLower(e.logFormat) {
	case "text":
		return slog.New(slog.NewTextHandler(w, opts)), nil
	case "json":
		return slog.New(slog.NewJSONHandler(w, opts)), nil
	}
	return nil, usageError{fmt.Errorf("--log-format %q: want text or json", e.logFormat)}
}

// RedisOpt parses --redis-url without connecting.
func (e *Env) RedisOpt() (asynq.RedisConnOpt, error) {
	opt, err := redisurl.Parse(e.redisURL)
	if err != nil {
		return nil, usageError{err}
	}
	return opt, nil
}

// Redis parses --redis-url and checks that Redis answers, selecting the
// URL's database: a server that is down, a wrong password or a database
// number the server does not have is one clear error, at once.
func (e *Env) Redis(ctx context.Context) (asynq.RedisConnOpt, error) {
	opt, err := e.RedisOpt()
	if err != nil {
		return nil, err
	}
	if err := pingRedis(ctx, opt, redisurl.Redact(e.redisURL)); err != nil {
		return nil, err
	}
	return opt, nil
}

func pingRedis(ctx context.Context, opt asynq.RedisConnOpt, where string) error {
	c, ok := opt.MakeRedisClient().(redis.UniversalClient)
	if !ok {
		return nil
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	err := c.Ping(ctx).Err()
	switch {
	case err == nil:
		return nil
	case strings.Contains(err.Error(), "DB index is out of range"):
		return fmt.Errorf("Redis at %s has no such database (%w): the server's `databases` setting limits the number in the URL", where, err)
	case errors.Is(err, context.Canceled):
		return err
	}
	if redisRefused(err) {
		// It answered, and said no: a wrong password, say.
		return fmt.Errorf("Redis at %s refused the connection: %w", where, err)
	}
	return fmt.Errorf("Redis at %s is not answering: %v", where, err)
}

// redisRefused tells whether pingRedis's error is Redis's own answer (a
// wrong password, no such database) rather than no answer.
func redisRefused(err error) bool {
	var refused redis.Error
	return errors.As(err, &refused)
}

// CreateDatabase creates the database --database-url names when it does
// not exist yet (migrate calls it, so a fresh machine needs no psql).
func (e *Env) CreateDatabase(ctx context.Context) error {
	return e.onServer(ctx, func(conn *pgx.Conn, name string, exists bool) error {
		if exists {
			return nil
		}
		_, err := conn.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize())
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "42P04" { // created meanwhile by another process
			return nil
		}
		return err
	})
}

// DatabaseExists reports whether the database --database-url names exists.
func (e *Env) DatabaseExists(ctx context.Context) (exists bool, err error) {
	err = e.onServer(ctx, func(_ *pgx.Conn, _ string, ok bool) error { exists = ok; return nil })
	return exists, err
}

// onServer connects to the server's postgres database and calls fn with the
// name of the database --database-url names and whether it exists.
func (e *Env) onServer(ctx context.Context, fn func(conn *pgx.Conn, name string, exists bool) error) error {
	cfg, err := pgx.ParseConfig(e.databaseURL)
	if err != nil {
		return usageError{fmt.Errorf("DATABASE_URL %q: %v", redisurl.Redact(e.databaseURL), err)}
	}
	name := cfg.Database
	cfg.Database = "postgres"
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return e.postgresError(err)
	}
	defer conn.Close(ctx)
	var exists bool
	if err := conn.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)`, name).Scan(&exists); err != nil {
		return err
	}
	return fn(conn, name, exists)
}

// postgresError turns a failure to connect into one line that says what is
// wrong: a database that does not exist is not a server that is down.
func (e *Env) postgresError(err error) error {
	where := redisurl.Redact(e.databaseURL)
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		switch pgErr.Code {
		case "3D000":
			return fmt.Errorf("Postgres at %s: %s: run `%s migrate`, which creates it", where, pgErr.Message, e.app.name())
		case "28000", "28P01":
			return fmt.Errorf("Postgres at %s refused the sign-in: %s", where, pgErr.Message)
		}
		return fmt.Errorf("Postgres at %s: %s (SQLSTATE %s)", where, pgErr.Message, pgErr.Code)
	}
	if errors.Is(err, context.Canceled) {
		return err
	}
	return fmt.Errorf("Postgres at %s is not answering: %v", where, err)
}

// Pool connects to the ledger's database without looking at its schema
// (migrate's view). Close it when done.
func (e *Env) Pool(ctx context.Context) (*pgxpool.Pool, error) { return e.PoolFor(ctx, e.poolConns) }

// PoolFor is Pool with at least conns connections, for a program that runs
// more than one worker (or a worker beside other users) on one pool: sum
// server.PoolSize of each worker's concurrency. The URL's pool_max_conns,
// when set, wins.
func (e *Env) PoolFor(ctx context.Context, conns int) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(e.databaseURL)
	if err != nil {
		return nil, usageError{fmt.Errorf("DATABASE_URL %q: %v", redisurl.Redact(e.databaseURL), err)}
	}
	if int(cfg.MaxConns) < conns && !strings.Contains(e.databaseURL, "pool_max_conns") {
		cfg.MaxConns = int32(conns)
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
		return nil, e.postgresError(err)
	}
	return pool, nil
}

// Ledger connects to the ledger and refuses a schema this program cannot
// use: every command that reads or writes jobs says "run `keel migrate`"
// alike. Close the pool when done.
func (e *Env) Ledger(ctx context.Context) (*pgxpool.Pool, error) {
	pool, err := e.Pool(ctx)
	if err != nil {
		return nil, err
	}
	if err := migrate.Check(ctx, pool); err != nil {
		pool.Close()
		return nil, e.migrateHint(err)
	}
	return pool, nil
}

// operator connects what an operator's action needs: the ledger and, with
// withRedis, asynq's Redis, checked first so that an outage is one clear
// error and not one per job. done closes both.
func (e *Env) operator(ctx context.Context, withRedis bool) (ops *inspect.Inspector, pool *pgxpool.Pool, done func(), err error) {
	var redisOpt asynq.RedisConnOpt
	if withRedis {
		if redisOpt, err = e.Redis(ctx); err != nil {
			return nil, nil, nil, err
		}
		redisOpt = redisconn.Follow(redisOpt)
	}
	if pool, err = e.Ledger(ctx); err != nil {
		return nil, nil, nil, err
	}
	if ops, err = inspect.New(inspect.Config{Pool: pool, Redis: redisOpt}); err != nil {
		pool.Close()
		return nil, nil, nil, err
	}
	return ops, pool, func() { ops.Close(); pool.Close() }, nil
}

// quotedKeelCommand matches a keel command a message quotes for a person
// to run (`keel dead resolve`).
var quotedKeelCommand = regexp.MustCompile("`keel (" + commandWords + ")\\b")

// own names this program, not keel, in the commands msg quotes: a program
// built with this package under its own name has no `keel dead resolve`.
func (e *Env) own(msg string) string {
	name := e.app.name()
	if name == "keel" {
		return msg
	}
	return quotedKeelCommand.ReplaceAllString(msg, "`"+name+" $1")
}

// migrateHint names this program in the ledger's "run `keel migrate`": a
// program's own migrate also creates its own tables.
func (e *Env) migrateHint(err error) error {
	if errors.Is(err, migrate.ErrSchemaTooNew) {
		return err
	}
	if msg := e.own(err.Error()); msg != err.Error() {
		return errors.New(msg)
	}
	return err
}

// WorkerFlags are the worker's own settings (--queues, --concurrency, …),
// for a program's own subcommands that run a worker.
type WorkerFlags struct {
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

// Bind adds the flags to cmd, with their environment defaults.
func (w *WorkerFlags) Bind(cmd *cobra.Command) {
	f := cmd.Flags()
	f.StringVar(&w.queues, "queues", envOr("KEEL_QUEUES", "critical:6,default:3,low:1"), "queues and weights (env KEEL_QUEUES)")
	f.IntVar(&w.concurrency, "concurrency", envInt("KEEL_CONCURRENCY", server.DefaultConcurrency), "jobs run at once (env KEEL_CONCURRENCY)")
	f.DurationVar(&w.shutdownTimeout, "shutdown-timeout", envDuration("KEEL_SHUTDOWN_TIMEOUT", server.DefaultShutdownTimeout),
		"time running jobs get to finish on SIGTERM (env KEEL_SHUTDOWN_TIMEOUT)")
	f.BoolVar(&w.strict, "strict-priority", envBool(cmd, "KEEL_STRICT_PRIORITY"), "drain higher-weight queues first (env KEEL_STRICT_PRIORITY)")
	f.BoolVar(&w.noRelay, "no-relay", envBool(cmd, "KEEL_NO_RELAY"), "do not run a relay inside the worker (env KEEL_NO_RELAY)")
	f.BoolVar(&w.noReconciler, "no-reconciler", envBool(cmd, "KEEL_NO_RECONCILER"),
		"do not run a reconciler/pruner inside the worker (env KEEL_NO_RECONCILER)")
	f.DurationVar(&w.retention, "retention", envDuration("KEEL_RETENTION", outbox.DefaultRetention),
		"keep succeeded/discarded jobs this long; also the business-key dedupe window (env KEEL_RETENTION)")
	w.reconcile.bind(cmd)
}

// Config checks the settings and returns the server configuration they
// describe, without connections.
func (w *WorkerFlags) Config() (server.Config, error) {
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

// Service is what a long-running subcommand connects to.
type Service struct {
	Log   *slog.Logger
	Redis asynq.RedisConnOpt
	Pool  *pgxpool.Pool
}

// Close closes the pool.
func (s *Service) Close() { s.Pool.Close() }

// Client returns a tasks client on the service's Redis and ledger; close it
// before the service.
func (s *Service) Client() (*tasks.Client, error) {
	return tasks.NewClient(tasks.ClientConfig{Redis: s.Redis, Pool: s.Pool, Logger: s.Log})
}

// Open checks the settings, checks that Redis answers, connects to the
// ledger and refuses a schema this program cannot use. Close it when done.
func (e *Env) Open(ctx context.Context) (*Service, error) {
	log := e.Logger()
	redis, err := e.Redis(ctx)
	if err != nil {
		return nil, err
	}
	pool, err := e.Ledger(ctx)
	if err != nil {
		return nil, err
	}
	return &Service{Log: log, Redis: redis, Pool: pool}, nil
}
