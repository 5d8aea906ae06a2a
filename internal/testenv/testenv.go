// Package testenv connects keel's tests to the real Redis and Postgres, each
// package isolated in its own Redis database number and Postgres schema so
// that `go test ./...` can run packages in parallel. Of keel it imports
// only migrate and internal/pgserver, so that any package's tests can use
// it; the helpers that run workers are in internal/testworker.
package testenv

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
)

// Redis database numbers, one per test package.
const (
	DBTasks = iota + 1
	DBIdempotency
	DBServer
	DBOutbox
	DBScheduler
	DBWeb
	DBCmd
	DBHandlers
	DBKeeltest
	DBBench
	DBFlow
	DBInspect
)

// RedisAddr is the test Redis (KEEL_TEST_REDIS_ADDR, default 127.0.0.1:6379).
func RedisAddr() string {
	if a := os.Getenv("KEEL_TEST_REDIS_ADDR"); a != "" {
		return a
	}
	return "127.0.0.1:6379"
}

// DatabaseURL is the test database (KEEL_TEST_DATABASE_URL).
func DatabaseURL() string {
	if u := os.Getenv("KEEL_TEST_DATABASE_URL"); u != "" {
		return u
	}
	return "postgres://postgres@127.0.0.1:5432/keel_test?sslmode=disable"
}

// Redis returns options for Redis database db, flushed.
func Redis(t testing.TB, db int) asynq.RedisClientOpt {
	t.Helper()
	lockPackage(t, fmt.Sprintf("db%d", db))
	opt := asynq.RedisClientOpt{Addr: RedisAddr(), DB: db}
	c := redis.NewClient(&redis.Options{Addr: opt.Addr, DB: db})
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := c.FlushDB(ctx).Err(); err != nil {
		t.Fatalf("testenv: Redis at %s is not answering (start it, see README): %v", opt.Addr, err)
	}
	return opt
}

// Pool returns a pool whose search_path is schema, a schema of the test's
// package, fresh: its tables empty and the ledger migrated into it (see
// freshPool).
func Pool(t testing.TB, schema string) *pgxpool.Pool {
	t.Helper()
	lockPackage(t, schema)
	return freshPool(t, schema, false, nil)
}

// PoolConfig creates (or recreates) schema and returns a pool config bound to
// it, creating the test database first if it does not exist.
func PoolConfig(ctx context.Context, schema string) (*pgxpool.Config, error) {
	url := DatabaseURL()
	if err := ensureDatabase(ctx, url); err != nil {
		return nil, err
	}
	conn, err := connect(ctx, url)
	if err != nil {
		return nil, fmt.Errorf("testenv: Postgres at %s is not answering (start it, see README): %w", url, err)
	}
	defer conn.Close(ctx)
	ident := pgx.Identifier{schema}.Sanitize()
	if _, err := conn.Exec(ctx, "DROP SCHEMA IF EXISTS "+ident+" CASCADE; CREATE SCHEMA "+ident); err != nil {
		return nil, fmt.Errorf("testenv: schema %s: %w", schema, err)
	}
	return poolConfig(schema)
}

// poolConfig is a pool config bound to schema, as it is.
func poolConfig(schema string) (*pgxpool.Config, error) {
	cfg, err := pgxpool.ParseConfig(DatabaseURL())
	if err != nil {
		return nil, err
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	// Names the schema's sessions, so that a schema some process still
	// uses is not handed to the next test (see freshPool).
	cfg.ConnConfig.RuntimeParams["application_name"] = schema
	cfg.MaxConns = 20
	cfg.MaxConnIdleTime, cfg.HealthCheckPeriod = idleConnTime, healthCheckPeriod
	return cfg, nil
}

// idleConnTime closes a test pool's idle connections soon (pgx keeps them
// half an hour): the packages' tests share one server, whose connection
// slots (100 by default) ran out in CI while most of them stood idle. The
// pool looks for them every healthCheckPeriod.
const idleConnTime, healthCheckPeriod = 3 * time.Second, time.Second

// IdlePoolParams are the URL parameters of a pool that closes its idle
// connections as the tests' pools do (for pgxpool, not pgx.Connect).
var IdlePoolParams = fmt.Sprintf("&pool_max_conn_idle_time=%s&pool_health_check_period=%s", idleConnTime, healthCheckPeriod)

// URL returns the test database URL bound to schema (for subprocesses).
func URL(schema string) string {
	u := DatabaseURL()
	sep := "?"
	for _, c := range u {
		if c == '?' {
			sep = "&"
		}
	}
	return u + sep + "search_path=" + schema + "&application_name=" + schema
}

func ensureDatabase(ctx context.Context, url string) error {
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		return err
	}
	name := cfg.Database
	cfg.Database = "postgres"
	conn, err := connectConfig(ctx, cfg, nil)
	if err != nil {
		return fmt.Errorf("testenv: Postgres at %s:%d is not answering (start it, see README): %w", cfg.Host, cfg.Port, err)
	}
	defer conn.Close(ctx)
	var exists bool
	if err := conn.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)`, name).Scan(&exists); err != nil {
		return err
	}
	if !exists {
		if _, err := conn.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()); err != nil {
			// Another package may have created it at the same moment.
			if err2 := conn.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)`, name).Scan(&exists); err2 != nil || !exists {
				return err
			}
		}
	}
	return nil
}

// connect opens a connection to url (see connectConfig).
func connect(ctx context.Context, url string) (*pgx.Conn, error) {
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		return nil, err
	}
	return connectConfig(ctx, cfg, nil)
}

// connectConfig opens a connection, waiting while the server has no
// connection slot free (53300) until ctx ends: the packages' tests share
// one server, and a helper that gave up at once failed a test that keel
// itself, which waits for a ledger out of slots, would have passed.
// refused, if set, is called at each refusal.
func connectConfig(ctx context.Context, cfg *pgx.ConnConfig, refused func()) (*pgx.Conn, error) {
	for {
		conn, err := pgx.ConnectConfig(ctx, cfg)
		var pgErr *pgconn.PgError
		if err == nil || !errors.As(err, &pgErr) || pgErr.Code != "53300" {
			return conn, err
		}
		if refused != nil {
			refused()
		}
		t := time.NewTimer(50 * time.Millisecond)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil, err
		case <-t.C:
		}
	}
}

// Eventually polls cond every 20ms until it is true or timeout passes.
func Eventually(t testing.TB, timeout time.Duration, cond func() bool, msg string, args ...any) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		if cond() {
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("timed out after %s: "+msg, append([]any{timeout}, args...)...)
}

var (
	lockMu sync.Mutex
	locked = map[string]*os.File{}
)

// lockPackage keeps two test processes of one package (two `go test` runs at
// once, say) from sharing, and flushing, one Redis DB or schema (key): the first
// holds a file lock for its lifetime, the second waits for it. Child
// processes inherit the holder's environment and do not wait.
func lockPackage(t testing.TB, key string) {
	t.Helper()
	env := "KEEL_TESTENV_LOCKED_" + key
	lockMu.Lock()
	defer lockMu.Unlock()
	if locked[key] != nil || os.Getenv(env) != "" {
		return
	}
	f, err := os.OpenFile(filepath.Join(os.TempDir(), "keel-testenv-"+key+".lock"), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		t.Fatalf("testenv: lock file: %v", err)
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX); err != nil {
		t.Fatalf("testenv: lock: %v", err)
	}
	locked[key] = f // held until the process exits
	os.Setenv(env, "1")
}

// PrivatePool returns a pool on a fresh schema held by this test alone,
// and the schema's name: a test with it (and a Redis of its own,
// StartRedis) shares nothing and can run in parallel with others.
func PrivatePool(t testing.TB) (*pgxpool.Pool, string) {
	t.Helper()
	for {
		schema := takeSlot(t)
		// A schema still in use stays held and out of the free list: the
		// process leaves it for good and takes another.
		if pool := freshPool(t, schema, true, func() { putSlot(schema) }); pool != nil {
			return pool, schema
		}
	}
}
