// Package keeltest runs your handlers through keel's real middleware against
// your real test Redis and Postgres, so jobs are never mocked away in tests:
//
//	func TestReceipt(t *testing.T) {
//		h := keeltest.New(t, keeltest.Options{RedisDB: 7})
//		mux := tasks.NewMux()
//		orders.Register(mux, deps(h.Pool))
//		job := h.Run(t, mux, orders.SendReceipt.New(orders.Receipt{OrderID: "1"}))
//		require.Equal(t, idempotency.StatusSucceeded, job.Status)
//	}
//
// Each Harness gets its own Postgres schema (migrated, dropped afterwards) and
// flushes its Redis database number, so give each test package its own
// RedisDB: go test runs packages in parallel.
package keeltest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"os"
	"slices"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/jobstore"
	"github.com/keeljobs/keel/migrate"
	"github.com/keeljobs/keel/outbox"
	"github.com/keeljobs/keel/server"
	"github.com/keeljobs/keel/tasks"
)

// Options say where the test services are. Zero values use the
// environment (KEEL_TEST_REDIS_ADDR, KEEL_TEST_DATABASE_URL) or the local
// defaults.
type Options struct {
	// RedisAddr defaults to $KEEL_TEST_REDIS_ADDR or 127.0.0.1:6379.
	RedisAddr string
	// RedisDB is the Redis database number the harness flushes and uses.
	// Give every test package its own. Default 15.
	RedisDB int
	// DatabaseURL defaults to $KEEL_TEST_DATABASE_URL or the local keel_test
	// database.
	DatabaseURL string
	// Queues the worker reads and the client accepts. Default critical,
	// default, low.
	Queues map[string]int
	// Configure, if set, adjusts the worker's configuration (retry policy,
	// middleware, flow limits) before it starts.
	Configure func(*server.Config)
}

// Harness is a ledger, a client and a way to run workers, for one test.
type Harness struct {
	Pool   *pgxpool.Pool
	Client *tasks.Client
	Redis  asynq.RedisClientOpt
	// Schema is the Postgres schema holding this harness's ledger; put your
	// own test tables there too (the pool's search_path points at it).
	Schema string
	opts   Options
	// redeliverWaited, set by keel's own tests only (export_test.go), is
	// called each time Redeliver finds asynq's copy still there.
	redeliverWaited func()
}

// New builds a harness and registers its cleanup with t.
func New(t testing.TB, opts Options) *Harness {
	t.Helper()
	if opts.RedisAddr == "" {
		opts.RedisAddr = envOr("KEEL_TEST_REDIS_ADDR", "127.0.0.1:6379")
	}
	if opts.RedisDB == 0 {
		opts.RedisDB = 15
	}
	if opts.DatabaseURL == "" {
		opts.DatabaseURL = envOr("KEEL_TEST_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/keel_test?sslmode=disable")
	}
	if len(opts.Queues) == 0 {
		opts.Queues = server.DefaultQueues()
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	h := &Harness{Redis: asynq.RedisClientOpt{Addr: opts.RedisAddr, DB: opts.RedisDB}, opts: opts}
	rc := redis.NewClient(&redis.Options{Addr: opts.RedisAddr, DB: opts.RedisDB})
	err := rc.FlushDB(ctx).Err()
	rc.Close()
	if err != nil {
		t.Fatalf("keeltest: Redis at %s: %v", opts.RedisAddr, err)
	}

	var suffix [6]byte
	_, _ = rand.Read(suffix[:])
	h.Schema = "keeltest_" + hex.EncodeToString(suffix[:])
	conn, err := pgx.Connect(ctx, opts.DatabaseURL)
	if err != nil {
		t.Fatalf("keeltest: Postgres: %v", err)
	}
	_, err = conn.Exec(ctx, "CREATE SCHEMA "+h.Schema)
	conn.Close(ctx)
	if err != nil {
		t.Fatalf("keeltest: create schema: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if conn, err := pgx.Connect(ctx, opts.DatabaseURL); err == nil {
			_, _ = conn.Exec(ctx, "DROP SCHEMA "+h.Schema+" CASCADE")
			conn.Close(ctx)
		}
	})
	cfg, err := pgxpool.ParseConfig(opts.DatabaseURL)
	if err != nil {
		t.Fatalf("keeltest: %v", err)
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = h.Schema
	if h.Pool, err = pgxpool.NewWithConfig(ctx, cfg); err != nil {
		t.Fatalf("keeltest: %v", err)
	}
	t.Cleanup(h.Pool.Close)
	if _, err := migrate.Up(ctx, h.Pool); err != nil {
		t.Fatalf("keeltest: migrate: %v", err)
	}
	queues := make([]string, 0, len(opts.Queues))
	for q := range opts.Queues {
		queues = append(queues, q)
	}
	h.Client, err = tasks.NewClient(tasks.ClientConfig{Redis: h.Redis, Pool: h.Pool, Queues: queues})
	if err != nil {
		t.Fatalf("keeltest: %v", err)
	}
	t.Cleanup(func() { h.Client.Close() })
	return h
}

func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

// Worker starts a real keel worker (ledger guard, classifier, relay) on mux
// until the test ends. Retries are quick (1s base) so a test can watch a
// job fail, retry and die within seconds.
func (h *Harness) Worker(t testing.TB, mux *tasks.Mux) {
	t.Helper()
	cfg := server.Config{Redis: h.Redis, Pool: h.Pool, Queues: h.opts.Queues, Concurrency: 10,
		ShutdownTimeout: 2 * time.Second,
		Relay:           outbox.RelayConfig{PollInterval: 100 * time.Millisecond},
		Reconciler:      outbox.ReconcilerConfig{Interval: time.Second, Grace: 5 * time.Second},
		Guard:           server.GuardConfig{Lease: 5 * time.Second, LedgerRetry: time.Second}}
	cfg.Retry.Base, cfg.Retry.Cap, cfg.Retry.WaitDelay = time.Second, 2*time.Second, time.Second
	if h.opts.Configure != nil {
		h.opts.Configure(&cfg)
	}
	srv, err := server.New(cfg, mux)
	if err != nil {
		t.Fatalf("keeltest: worker: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("keeltest: worker: %v", err)
		}
	})
}

// Run enqueues task, runs a worker on mux and returns the job once it has
// succeeded or died (or fails the test after 60 s).
func (h *Harness) Run(t testing.TB, mux *tasks.Mux, task *tasks.Task) idempotency.Job {
	t.Helper()
	res, err := h.Client.Enqueue(context.Background(), task)
	if err != nil {
		t.Fatalf("keeltest: enqueue: %v", err)
	}
	h.Worker(t, mux)
	return h.Wait(t, res.Job.ID, 60*time.Second, idempotency.StatusSucceeded, idempotency.StatusDead)
}

// Wait polls the ledger until job id reaches one of statuses.
func (h *Harness) Wait(t testing.TB, id string, timeout time.Duration, statuses ...idempotency.Status) idempotency.Job {
	t.Helper()
	deadline := time.Now().Add(timeout)
	var j idempotency.Job
	var err error
	for time.Now().Before(deadline) {
		j, err = h.Client.Inspector().Get(context.Background(), id)
		if err == nil && slices.Contains(statuses, j.Status) {
			return j
		}
		time.Sleep(25 * time.Millisecond)
	}
	t.Fatalf("keeltest: job %s did not reach %v within %s (now %s, last error %q, err %v)", id, statuses, timeout, j.Status, j.LastError, err)
	return j
}

// Redeliver publishes job id to Redis again, as a duplicate delivery would
// (after a Redis failover, say): a handler written with keel must not repeat
// its effects. If a worker still holds asynq's copy (its handler has not
// returned), Redeliver waits up to 30 s for it to let go.
func (h *Harness) Redeliver(t testing.TB, id string) {
	t.Helper()
	j, err := h.Client.Inspector().Get(context.Background(), id)
	if err != nil {
		t.Fatalf("keeltest: %v", err)
	}
	c := asynq.NewClient(h.Redis)
	defer c.Close()
	insp := asynq.NewInspector(h.Redis)
	defer insp.Close()
	// The ledger records an outcome before the worker lets go of asynq's
	// copy (InTx commits before the handler returns): wait for it.
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		err := insp.DeleteTask(j.Queue, j.ID)
		if err == nil || errors.Is(err, asynq.ErrTaskNotFound) || errors.Is(err, asynq.ErrQueueNotFound) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("keeltest: redeliver: asynq's copy of job %s is still there after 30 s: %v", id, err)
		}
		if h.redeliverWaited != nil {
			h.redeliverWaited()
		}
	}
	if _, err := c.Enqueue(jobstore.Task(j), jobstore.TaskOptions(j)...); err != nil {
		t.Fatalf("keeltest: redeliver: %v", err)
	}
}

// Enqueued returns the job of (kind, key) as db sees it — pass the
// transaction your code enqueued in to check before it commits — and fails
// the test if there is none.
func Enqueued(t testing.TB, db DB, kind, key string) idempotency.Job {
	t.Helper()
	j, err := LookupIn(context.Background(), db, kind, key)
	if err != nil {
		t.Fatalf("keeltest: expected a %s job with key %q: %v", kind, key, err)
	}
	return j
}

// NotEnqueued fails the test if db holds a job of (kind, key).
func NotEnqueued(t testing.TB, db DB, kind, key string) {
	t.Helper()
	j, err := LookupIn(context.Background(), db, kind, key)
	if err == nil {
		t.Fatalf("keeltest: expected no %s job with key %q, found %s (%s)", kind, key, j.ID, j.Status)
	}
	if !errors.Is(err, idempotency.ErrNotFound) {
		t.Fatalf("keeltest: %v", err)
	}
}

// LookupIn finds the job of (kind, key) through db (a pool or a transaction).
func LookupIn(ctx context.Context, db DB, kind, key string) (idempotency.Job, error) {
	return jobstore.LookupIn(ctx, db, kind, key)
}

// Drain waits until no task is pending, scheduled, retrying or running in
// any of the harness's queues, so that effects of every delivery made so
// far (a Redeliver, say) are visible.
func (h *Harness) Drain(t testing.TB, timeout time.Duration) {
	t.Helper()
	insp := asynq.NewInspector(h.Redis)
	defer insp.Close()
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		busy := 0
		for q := range h.opts.Queues {
			info, err := insp.GetQueueInfo(q)
			if err != nil {
				continue // a queue nothing was ever enqueued to
			}
			busy += info.Pending + info.Active + info.Scheduled + info.Retry
		}
		if busy == 0 {
			return
		}
		time.Sleep(25 * time.Millisecond)
	}
	t.Fatalf("keeltest: queues not drained within %s", timeout)
}

// DB is a pool or a transaction (pgxpool.Pool, pgx.Tx, pgx.Conn).
type DB interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}
