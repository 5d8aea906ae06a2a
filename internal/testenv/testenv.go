// Package testenv connects keel's tests to the real Redis and Postgres, each
// package isolated in its own Redis database number and Postgres schema so
// that `go test ./...` can run packages in parallel. Of keel it imports
// only migrate and internal/pgserver, so that any package's tests can use
// it; the helpers that run workers are in internal/testworker.
package testenv

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/keeljobs/keel/migrate"
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

// Pool returns a pool whose search_path is a fresh schema with the ledger
// migrated into it. The schema is dropped and recreated on each call.
func Pool(t testing.TB, schema string) *pgxpool.Pool {
	t.Helper()
	lockPackage(t, schema)
	return migratedPool(t, schema, nil)
}

// migratedPool (re)creates schema, migrates it and returns a pool on it,
// closed when the test ends; cleanup, if set, runs after the close.
func migratedPool(t testing.TB, schema string, cleanup func()) *pgxpool.Pool {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cfg, err := PoolConfig(ctx, schema)
	if err != nil {
		t.Fatal(err)
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		pool.Close()
		if cleanup != nil {
			cleanup()
		}
	})
	if _, err := migrate.Up(ctx, pool); err != nil {
		t.Fatalf("testenv: migrate: %v", err)
	}
	return pool
}

// PoolConfig creates (or recreates) schema and returns a pool config bound to
// it, creating the test database first if it does not exist.
func PoolConfig(ctx context.Context, schema string) (*pgxpool.Config, error) {
	url := DatabaseURL()
	if err := ensureDatabase(ctx, url); err != nil {
		return nil, err
	}
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return nil, fmt.Errorf("testenv: Postgres at %s is not answering (start it, see README): %w", url, err)
	}
	defer conn.Close(ctx)
	ident := pgx.Identifier{schema}.Sanitize()
	if _, err := conn.Exec(ctx, "DROP SCHEMA IF EXISTS "+ident+" CASCADE; CREATE SCHEMA "+ident); err != nil {
		return nil, fmt.Errorf("testenv: schema %s: %w", schema, err)
	}
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, err
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	cfg.MaxConns = 20
	return cfg, nil
}

// URL returns the test database URL bound to schema (for subprocesses).
func URL(schema string) string {
	u := DatabaseURL()
	sep := "?"
	for _, c := range u {
		if c == '?' {
			sep = "&"
		}
	}
	return u + sep + "search_path=" + schema
}

func ensureDatabase(ctx context.Context, url string) error {
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		return err
	}
	name := cfg.Database
	cfg.Database = "postgres"
	conn, err := pgx.ConnectConfig(ctx, cfg)
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

var privateSchemas atomic.Uint64

// PrivatePool returns a pool on a new, migrated schema of its own, named
// after prefix and unique to this process, dropped when the test ends: a
// test with it (and a Redis of its own, StartRedis) shares nothing and can
// run in parallel with others.
func PrivatePool(t testing.TB, prefix string) (*pgxpool.Pool, string) {
	t.Helper()
	schema := fmt.Sprintf("%s_%d_%d", prefix, os.Getpid(), privateSchemas.Add(1))
	return migratedPool(t, schema, func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if conn, err := pgx.Connect(ctx, DatabaseURL()); err == nil {
			conn.Exec(ctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{schema}.Sanitize()+" CASCADE") //nolint:errcheck // a leftover is recreated by name
			conn.Close(ctx)
		}
	}), schema
}
