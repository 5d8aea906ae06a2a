package guarantees_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/testenv"
	"github.com/keeljobs/keel/internal/testworker"
	"github.com/keeljobs/keel/server"
	"github.com/keeljobs/keel/tasks"
)

var outlasts = tasks.Define[item]("hunt:outlasts_redis", tasks.MaxRetry(0), tasks.Key(func(i item) string { return i.ID }))

// Redis going away for longer than asynq's task lease (30 s: a Sentinel
// failover with its default down-after, a restart loading a large AOF)
// makes asynq cancel every handler it runs. The ledger, which keel's
// leases live in, stayed up: the job is not to blame. The step's call in
// flight must be let finish rather than be cut off into doubt, and the
// run must not be charged as a failed attempt: the job still succeeds,
// with its call made once.
//
// The 30 s are real: asynq keeps its lease, and cancels on it, in the
// worker's memory, where no test can move its clock. So the outage begins
// before the test waits its turn among the parallel tests (this file's
// name puts it first in the package), and the seconds run meanwhile.
func TestARedisOutageLongerThanAsynqsLeaseCostsTheRunningJobNothing(t *testing.T) {
	e := setupAlone(t)
	ctx := context.Background()
	finish := make(chan struct{})
	cut := make(chan struct{})
	var cutOnce sync.Once
	var calls int
	var mu sync.Mutex

	mux := tasks.NewMux()
	tasks.Handle(mux, outlasts, func(ctx context.Context, i item) error {
		context.AfterFunc(ctx, func() { cutOnce.Do(func() { close(cut) }) })
		err := idempotency.Step(ctx, "call", func(cctx context.Context, key string) error {
			mu.Lock()
			calls++
			mu.Unlock()
			select {
			case <-finish:
				return nil
			case <-cctx.Done():
				return cctx.Err() // a call cut off after it left: in doubt
			}
		})
		if err != nil {
			return err
		}
		return idempotency.InTx(ctx, func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `INSERT INTO effects (job_id) VALUES ($1)`, i.ID)
			return err
		})
	})
	cfg := server.Config{Redis: e.redisOpt(), Pool: e.pool, Concurrency: 2}
	// Redis comes back empty: the reconciler publishes the released job
	// again once it was left alone for its grace, which is not the point.
	cfg.Reconciler.Interval, cfg.Reconciler.Grace = 200*time.Millisecond, 200*time.Millisecond
	testworker.RunServer(t, cfg, mux)

	res, err := e.client.Enqueue(ctx, outlasts.New(item{ID: "o1"}))
	require.NoError(t, err)
	testenv.Eventually(t, 20*time.Second, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return calls == 1
	}, "the step's call never started")

	e.redis.Stop()
	t.Parallel()
	select {
	case <-cut: // asynq's lease ran out and it cancelled the handler
	case <-time.After(90 * time.Second): // asynq's 30 s lease, seen on a 5 s heartbeat
		t.Fatal("asynq never cancelled the handler")
	}
	e.redis.Start()
	close(finish)

	j := testworker.WaitStatus(t, e.store, res.Job.ID, idempotency.StatusSucceeded, 40*time.Second)
	require.Equal(t, 1, j.Attempts)
	mu.Lock()
	require.Equal(t, 1, calls, "the step's call was made again")
	mu.Unlock()
	require.Equal(t, 1, e.count(t, `SELECT count(*) FROM effects`))
}
