package chaos_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/keeljobs/keel/flow"
	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/outbox"
	"github.com/keeljobs/keel/retry"
	"github.com/keeljobs/keel/server"
)

// Environment of a worker child.
const (
	envWorker      = "KEEL_CHAOS_WORKER"
	envWorkerDB    = "KEEL_CHAOS_WORKER_DATABASE_URL"
	envWorkerRedis = "KEEL_CHAOS_WORKER_REDIS_ADDR"
	// envWorkerService is fakeService's base URL.
	envWorkerService = "KEEL_CHAOS_WORKER_SERVICE_URL"
)

// workerPoolConns bounds each child's Postgres connections: the soak shares
// the server with the other packages' tests.
const workerPoolConns = 8

// parentPoolConns bounds the soak's own: its submitters, the scheduler and
// its checks.
const parentPoolConns = 10

// workerConfig is the worker the soak runs: short reconciler interval and
// grace, a short ledger lease and short backoff, so that every repair
// happens within the run.
func workerConfig(opt asynq.RedisConnOpt, pool *pgxpool.Pool, limits *flow.Controller, log *slog.Logger) server.Config {
	return server.Config{
		Redis:       opt,
		Pool:        pool,
		Concurrency: 20,
		// Shorter than a deploy job's run, so a SIGTERM always cuts some short.
		ShutdownTimeout: 3 * time.Second,
		Retry:           retry.Policy{Base: time.Second, Cap: 3 * time.Second},
		// The holder names the worker, so the parent can tell whose job is whose.
		// A hung handler is given up a second after its deadline.
		Guard: server.GuardConfig{Holder: os.Getenv(envWorker), Lease: 3 * time.Second, LedgerRetry: 2 * time.Second,
			TimeoutGrace: time.Second},
		Relay: outbox.RelayConfig{PollInterval: 500 * time.Millisecond},
		// Pruning stays off: the final check reads every row.
		Reconciler: outbox.ReconcilerConfig{Interval: time.Second, Grace: 2 * time.Second, Retention: -1},
		Middleware: []func(asynq.Handler) asynq.Handler{limits.Middleware},
		Logger:     log,
	}
}

// runWorkerChild is the body of a worker process; it returns the exit code.
func runWorkerChild() int {
	name := os.Getenv(envWorker)
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})).With("worker", name)
	// The parent holds our stdin open: EOF means it is gone, and a worker
	// left behind would keep running against the shared database.
	go func() {
		_, _ = io.Copy(io.Discard, os.Stdin)
		log.Error("chaos worker: parent gone, exiting")
		os.Exit(3)
	}()
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	pool, err := pgxpool.New(ctx, os.Getenv(envWorkerDB))
	if err != nil {
		log.Error("chaos worker: pool", "err", err)
		return 2
	}
	defer pool.Close()
	opt := asynq.RedisClientOpt{Addr: os.Getenv(envWorkerRedis)}
	limits, err := flow.New(flow.Config{Redis: opt, Logger: log, Rules: []flow.Rule{
		{Name: "chaos-limited", Kinds: []string{limitedKind.Name()}, Rate: limitedRate},
	}})
	if err != nil {
		log.Error("chaos worker: flow", "err", err)
		return 2
	}
	defer limits.Close()
	cfg := workerConfig(opt, pool, limits, log)
	// Every death is alerted once: recorded, so the check can tell which
	// jobs made a dead letter (a deploy must not, nor an expired job).
	cfg.Guard.OnDead = func(ctx context.Context, e idempotency.DeadEvent) {
		actx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		if _, err := pool.Exec(actx, `INSERT INTO chaos_alerts (job_id, kind, class) VALUES ($1, $2, $3)`, e.JobID, e.Kind, e.Class); err != nil {
			log.Warn("chaos worker: could not record an alert", "job_id", e.JobID, "err", err)
		}
		e.LogDied(ctx, log)
	}
	srv, err := server.New(cfg, chaosMux(pool, newServiceClient(os.Getenv(envWorkerService)), log))
	if err != nil {
		log.Error("chaos worker: server", "err", err)
		return 2
	}
	if err := srv.Run(ctx); err != nil {
		log.Error("chaos worker: run", "err", err)
		return 2
	}
	return 0
}

// worker is one child process as the parent sees it.
type worker struct {
	slot, gen int
	cmd       *exec.Cmd
	stdin     io.WriteCloser // held open: closing it tells the child to exit
	logPath   string
	done      chan struct{}
	exitErr   error
	expected  atomic.Bool // killed or stopped on purpose
}

// startWorker starts generation gen of worker slot.
func (d *driver) startWorker(slot, gen int) (*worker, error) {
	w := &worker{slot: slot, gen: gen, done: make(chan struct{}),
		logPath: filepath.Join(d.logDir, fmt.Sprintf("worker%d.%d.log", slot, gen))}
	f, err := os.Create(w.logPath)
	if err != nil {
		return nil, err
	}
	w.cmd = exec.Command(os.Args[0], "-test.run=^$")
	w.cmd.Env = append(os.Environ(),
		envWorker+"="+w.holder(),
		envWorkerDB+"="+d.workerDBURL,
		envWorkerRedis+"="+d.redis.Addr(),
		envWorkerService+"="+d.service.URL())
	w.cmd.Stdout, w.cmd.Stderr = f, f
	if w.stdin, err = w.cmd.StdinPipe(); err != nil {
		f.Close()
		return nil, err
	}
	if err := w.cmd.Start(); err != nil {
		f.Close()
		return nil, err
	}
	go func() {
		w.exitErr = w.cmd.Wait()
		f.Close()
		switch {
		case poisoned(w.exitErr):
			// A poison job killed it: start the next generation, as a
			// supervisor (systemd, Kubernetes) would.
			d.respawn(w)
		case !w.expected.Load():
			d.unexpectedExit.Store(fmt.Sprintf("worker %d.%d exited on its own: %v (log %s)", slot, gen, w.exitErr, w.logPath))
		}
		close(w.done)
	}()
	return w, nil
}

// poisoned reports whether a worker's exit was a poison job's doing.
func poisoned(exitErr error) bool {
	var ee *exec.ExitError
	return errors.As(exitErr, &ee) && ee.ExitCode() == poisonExit
}

// holder is the worker's name, also its ledger lease holder.
func (w *worker) holder() string { return fmt.Sprintf("chaos-w%d.%d", w.slot, w.gen) }

// kill SIGKILLs the worker and waits for it to be gone.
func (w *worker) kill() {
	w.expected.Store(true)
	_ = w.cmd.Process.Signal(syscall.SIGKILL)
	<-w.done
}

// stop asks the worker to shut down gracefully; it reports whether it did,
// with exit status 0, within timeout (a race report makes the status 66).
func (w *worker) stop(timeout time.Duration) error {
	w.expected.Store(true)
	_ = w.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-w.done:
		if w.exitErr != nil {
			return fmt.Errorf("worker %d.%d: %w", w.slot, w.gen, w.exitErr)
		}
		return nil
	case <-time.After(timeout):
		_ = w.cmd.Process.Signal(syscall.SIGKILL)
		<-w.done
		return fmt.Errorf("worker %d.%d did not stop within %s", w.slot, w.gen, timeout)
	}
}
