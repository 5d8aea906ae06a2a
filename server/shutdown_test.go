package server_test

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/testenv"
	"github.com/keeljobs/keel/server"
	"github.com/keeljobs/keel/tasks"
)

// The child worker is configured through its environment.
const (
	childEnv         = "KEEL_SERVER_CHILD"          // "1": run as a child worker
	childWorkEnv     = "KEEL_SERVER_CHILD_WORK"     // how long its handler works
	childShutdownEnv = "KEEL_SERVER_CHILD_SHUTDOWN" // its ShutdownTimeout
	childSchemaEnv   = "KEEL_SERVER_CHILD_SCHEMA"   // the test's ledger schema
	childRedisEnv    = "KEEL_SERVER_CHILD_REDIS"    // the test's Redis address
	childLease       = 3 * time.Second              // its ledger lease, short so a takeover is quick
)

var work = tasks.Define[order]("test:work", tasks.Key(func(o order) string { return "work:" + o.OrderID }))

// runChildWorker runs a worker until SIGTERM or SIGINT, as a deployed keel
// worker does, and returns the process exit code. Its handler marks when it
// starts and when it completes; it works for the configured time unless its
// context is cancelled first.
func runChildWorker() int {
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	workFor, err1 := time.ParseDuration(os.Getenv(childWorkEnv))
	shutdown, err2 := time.ParseDuration(os.Getenv(childShutdownEnv))
	if err := errors.Join(err1, err2); err != nil {
		log.Error("child: bad settings", "err", err)
		return 2
	}
	pool, err := pgxpool.New(context.Background(), testenv.URL(os.Getenv(childSchemaEnv)))
	if err != nil {
		log.Error("child: pool", "err", err)
		return 2
	}
	defer pool.Close()

	mux := tasks.NewMux()
	tasks.Handle(mux, work, func(ctx context.Context, o order) error {
		id, _ := idempotency.JobID(ctx)
		if err := mark(ctx, pool, id, "started", "child"); err != nil {
			return err
		}
		select {
		case <-time.After(workFor):
		case <-ctx.Done():
			return ctx.Err()
		}
		return mark(context.WithoutCancel(ctx), pool, id, "completed", "child")
	})
	cfg := server.Config{
		Redis:           asynq.RedisClientOpt{Addr: os.Getenv(childRedisEnv)},
		Pool:            pool,
		Concurrency:     2,
		ShutdownTimeout: shutdown,
		DisableRelay:    true,
		Logger:          log,
	}
	cfg.Guard.Lease = childLease
	srv, err := server.New(cfg, mux)
	if err != nil {
		log.Error("child: new", "err", err)
		return 2
	}
	if err := srv.Run(ctx); err != nil {
		log.Error("child: run", "err", err)
		return 1
	}
	return 0
}

type child struct {
	cmd  *exec.Cmd
	out  bytes.Buffer
	done chan error
}

func startChild(t *testing.T, b *bundle, workFor, shutdown time.Duration) *child {
	t.Helper()
	c := &child{done: make(chan error, 1)}
	c.cmd = exec.Command(os.Args[0], "-test.run=^$")
	c.cmd.Env = append(os.Environ(), childEnv+"=1", childSchemaEnv+"="+b.schema, childRedisEnv+"="+b.redis.Addr,
		childWorkEnv+"="+workFor.String(), childShutdownEnv+"="+shutdown.String())
	c.cmd.Stdout, c.cmd.Stderr = &c.out, &c.out
	require.NoError(t, c.cmd.Start())
	go func() { c.done <- c.cmd.Wait() }()
	t.Cleanup(func() {
		select {
		case <-c.done:
		default:
			_ = c.cmd.Process.Kill()
			<-c.done
		}
		if t.Failed() {
			t.Logf("child worker output:\n%s", c.out.String())
		}
	})
	return c
}

// waitStarted waits until the child's handler has started job id.
func (c *child) waitStarted(t *testing.T, b *bundle, id string) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for b.marks(t, id, "started", "child") == 0 {
		select {
		case err := <-c.done:
			c.done <- err
			t.Fatalf("child worker exited before the job started: %v", err)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatal("child worker never started the job")
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// terminate sends SIGTERM and waits for the child to exit with status 0.
func (c *child) terminate(t *testing.T) time.Duration {
	t.Helper()
	start := time.Now()
	require.NoError(t, c.cmd.Process.Signal(syscall.SIGTERM))
	select {
	case err := <-c.done:
		c.done <- err
		require.NoError(t, err, "the worker must exit 0 after SIGTERM")
	case <-time.After(20 * time.Second):
		t.Fatal("the worker did not exit within 20s of SIGTERM")
	}
	return time.Since(start)
}

// A job still running when the shutdown timeout ends goes back to its queue
// and is completed, once, by another worker.
func TestSIGTERMRequeuesUnfinishedJob(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	res, err := b.client.Enqueue(ctx, work.New(order{OrderID: "long"}))
	require.NoError(t, err)

	c := startChild(t, b, 30*time.Second, time.Second)
	c.waitStarted(t, b, res.Job.ID)
	took := c.terminate(t)
	t.Logf("the worker exited %s after SIGTERM", took)

	require.Equal(t, 0, b.marks(t, res.Job.ID, "completed", ""))
	j, err := b.store.Get(ctx, res.Job.ID)
	require.NoError(t, err)
	require.NotEqual(t, idempotency.StatusSucceeded, j.Status)
	require.False(t, j.Status.Terminal())
	info, err := b.insp.GetTaskInfo("default", res.Job.ID)
	require.NoError(t, err, "the unfinished job must still be in Redis")
	require.Contains(t, []asynq.TaskState{asynq.TaskStatePending, asynq.TaskStateRetry}, info.State)

	// A new worker takes it over (after the dead worker's lease, if it still
	// holds one) and completes it.
	var runs atomic.Int32
	mux := tasks.NewMux()
	tasks.Handle(mux, work, func(ctx context.Context, o order) error {
		runs.Add(1)
		id, _ := idempotency.JobID(ctx)
		return mark(ctx, b.pool, id, "completed", "parent")
	})
	b.startWorker(t, mux, nil)
	j = b.waitStatus(t, res.Job.ID, idempotency.StatusSucceeded, 30*time.Second)
	require.EqualValues(t, 1, runs.Load())
	require.Equal(t, 1, b.marks(t, res.Job.ID, "completed", ""), "the job must complete exactly once")
	require.Equal(t, 1, b.marks(t, res.Job.ID, "completed", "parent"))
	require.Equal(t, 1, b.marks(t, res.Job.ID, "started", "child"))
	testenv.Eventually(t, 10*time.Second, func() bool {
		_, err := b.insp.GetTaskInfo("default", res.Job.ID)
		return errors.Is(err, asynq.ErrTaskNotFound)
	}, "the finished job should leave Redis")
}

// A job that finishes within the shutdown timeout is completed and recorded
// before the worker exits.
func TestSIGTERMLetsRunningJobFinish(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	res, err := b.client.Enqueue(ctx, work.New(order{OrderID: "short"}))
	require.NoError(t, err)

	c := startChild(t, b, time.Second, 5*time.Second)
	c.waitStarted(t, b, res.Job.ID)
	c.terminate(t)

	j, err := b.store.Get(ctx, res.Job.ID)
	require.NoError(t, err)
	require.Equal(t, idempotency.StatusSucceeded, j.Status, "the job finished inside the shutdown timeout")
	require.Equal(t, 1, j.Attempts)
	require.Equal(t, 1, b.marks(t, res.Job.ID, "completed", "child"))
	_, err = b.insp.GetTaskInfo("default", res.Job.ID)
	require.ErrorIs(t, err, asynq.ErrTaskNotFound, "asynq must not hold a finished job")
}
