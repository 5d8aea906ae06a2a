package executor_test

import (
	"context"
	"os"
	"os/exec"
	"syscall"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/executor"
	"github.com/keeljobs/keel/internal/testenv"
	"github.com/keeljobs/keel/internal/testworker"
	"github.com/keeljobs/keel/server"
	"github.com/keeljobs/keel/tasks"
)

const childEnv = "KEEL_IDEMPOTENCY_CHILD"

var (
	killLocal    = tasks.Define[order]("test:kill_local", tasks.Key(func(o order) string { return o.OrderID }))
	killStep     = tasks.Define[order]("test:kill_step", tasks.Key(func(o order) string { return o.OrderID }))
	killVerified = tasks.Define[order]("test:kill_verified", tasks.Key(func(o order) string { return o.OrderID }))
)

// crashMux is the handler set of the crash test. slow makes every handler
// stop in the middle of its work, where the parent kills the process.
func crashMux(pool *pgxpool.Pool, slow bool) *tasks.Mux {
	pause := func(ctx context.Context) {
		if slow {
			select {
			case <-ctx.Done():
			case <-time.After(time.Minute):
			}
		}
	}
	started := func(ctx context.Context) error {
		id, _ := idempotency.JobID(ctx)
		_, err := pool.Exec(ctx, `INSERT INTO started (job_id) VALUES ($1)`, id)
		return err
	}
	// The "external service": it records every call it receives.
	external := func(ctx context.Context, key string) error {
		_, err := pool.Exec(ctx, `INSERT INTO external_calls (key) VALUES ($1)`, key)
		return err
	}
	mux := tasks.NewMux()
	tasks.Handle(mux, killLocal, func(ctx context.Context, o order) error {
		if err := started(ctx); err != nil {
			return err
		}
		return idempotency.InTx(ctx, func(tx pgx.Tx) error {
			id, _ := idempotency.JobID(ctx)
			if _, err := tx.Exec(ctx, `INSERT INTO effects (job_id, name) VALUES ($1, 'local')`, id); err != nil {
				return err
			}
			pause(ctx) // killed here: the effect is written but not committed
			return nil
		})
	})
	tasks.Handle(mux, killStep, func(ctx context.Context, o order) error {
		if err := started(ctx); err != nil {
			return err
		}
		return idempotency.Step(ctx, "charge", func(ctx context.Context, key string) error {
			if err := external(ctx, key); err != nil {
				return err
			}
			pause(ctx) // killed here: the call happened, its outcome is unrecorded
			return nil
		})
	})
	tasks.Handle(mux, killVerified, func(ctx context.Context, o order) error {
		if err := started(ctx); err != nil {
			return err
		}
		return idempotency.Step(ctx, "charge", func(ctx context.Context, key string) error {
			if err := external(ctx, key); err != nil {
				return err
			}
			pause(ctx)
			return nil
		}, idempotency.Verify(func(ctx context.Context, key string) (bool, error) {
			var n int
			err := pool.QueryRow(ctx, `SELECT count(*) FROM external_calls WHERE key = $1`, key).Scan(&n)
			return n > 0, err
		}))
	})
	return mux
}

// runWorkerChild runs a worker when the test binary is started as the crash
// test's child process.
func runWorkerChild() bool {
	return testworker.RunChildWorker(childEnv, func(pool *pgxpool.Pool) (server.Config, asynq.Handler) {
		return server.Config{
			Redis:        redisOpt(),
			Concurrency:  5,
			DisableRelay: true,
			Guard:        executor.GuardConfig{Lease: 2 * time.Second},
		}, crashMux(pool, true)
	})
}

// A worker killed with SIGKILL in the middle of its jobs: after another
// worker's rescuer hands them back, the local effect exists once, the
// unverifiable external call is parked for a person, and the verifiable one
// is not repeated.
func TestWorkerKilledMidTask(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	_, err := b.pool.Exec(ctx, `CREATE TABLE started (job_id text); CREATE TABLE external_calls (key text)`)
	require.NoError(t, err)

	local, err := b.client.Enqueue(ctx, killLocal.New(order{OrderID: "k1"}))
	require.NoError(t, err)
	step, err := b.client.Enqueue(ctx, killStep.New(order{OrderID: "k2"}))
	require.NoError(t, err)
	verified, err := b.client.Enqueue(ctx, killVerified.New(order{OrderID: "k3"}))
	require.NoError(t, err)

	child := exec.Command(os.Args[0], "-test.run=^$")
	child.Env = b.childEnv(childEnv)
	child.Stdout, child.Stderr = os.Stderr, os.Stderr
	require.NoError(t, child.Start())
	t.Cleanup(func() { _ = child.Process.Kill(); _ = child.Wait() }) // if the test fails before the kill
	testenv.Eventually(t, 20*time.Second, func() bool {
		return b.count(t, `SELECT count(*) FROM started`) == 3 && b.count(t, `SELECT count(*) FROM external_calls`) == 2
	}, "the child never got into all three handlers")
	require.NoError(t, child.Process.Signal(syscall.SIGKILL))
	_ = child.Wait()

	j, err := b.store.Get(ctx, local.Job.ID)
	require.NoError(t, err)
	require.Equal(t, idempotency.StatusRunning, j.Status, "the killed worker's claim stays until its lease expires")
	require.Equal(t, 0, b.count(t, `SELECT count(*) FROM effects`), "an uncommitted effect is visible")

	testworker.LapseKilledWorker(t, b.pool, b.redis, child.Process.Pid)
	b.startWorker(t, crashMux(b.pool, false), func(c *server.Config) { c.Guard.Lease = 2 * time.Second })
	const recovery = 30 * time.Second // a deadlock guard: the rescuer looks every second
	b.waitStatus(t, local.Job.ID, idempotency.StatusSucceeded, recovery)
	dead := b.waitStatus(t, step.Job.ID, idempotency.StatusDead, recovery)
	b.waitStatus(t, verified.Job.ID, idempotency.StatusSucceeded, recovery)

	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM effects WHERE job_id = $1`, local.Job.ID), "local effect not exactly once")
	require.Contains(t, dead.LastError, "in doubt: needs a person")
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM external_calls WHERE key = $1`, idempotency.StepKey(step.Job.ID, "charge")),
		"an in-doubt external call was repeated")
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM external_calls WHERE key = $1`, idempotency.StepKey(verified.Job.ID, "charge")),
		"a verified external call was repeated")
	steps, err := b.store.Steps(ctx, verified.Job.ID)
	require.NoError(t, err)
	require.Equal(t, "done", steps[0].Status)
}
