package idempotency_test

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/testenv"
	"github.com/keeljobs/keel/server"
	"github.com/keeljobs/keel/tasks"
)

// Where two of keel's mechanisms meet: the completing InTx and a deploy,
// the completing InTx and the timeout watchdog, asynq's retry count and the
// ledger's budget.

var (
	committedThenCut  = tasks.Define[order]("joint:committed_then_cut", tasks.MaxRetry(0), tasks.Key(func(o order) string { return o.OrderID }))
	committedThenHung = tasks.Define[order]("joint:committed_then_hung", tasks.MaxRetry(0), tasks.Timeout(time.Second),
		tasks.Key(func(o order) string { return o.OrderID }))
	cancelledOften = tasks.Define[order]("joint:cancelled_often", tasks.MaxRetry(2), tasks.Key(func(o order) string { return o.OrderID }))
)

// deathLog records the deaths a worker reports.
type deathLog struct{ n atomic.Int32 }

func (d *deathLog) onDead(context.Context, idempotency.DeadEvent) { d.n.Add(1) }

// A deploy whose shutdown cancels handlers after their completing InTx
// committed, handlers that then return the context's error: the jobs
// succeeded. No dead letter, no alert.
func TestADeployAfterTheCompletingInTxIsASuccess(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	committed := make(chan string, 3)
	mux := tasks.NewMux()
	tasks.Handle(mux, committedThenCut, func(ctx context.Context, o order) error {
		if err := idempotency.InTx(ctx, func(tx pgx.Tx) error {
			id, _ := idempotency.JobID(ctx)
			_, err := tx.Exec(ctx, `INSERT INTO effects (job_id, name) VALUES ($1, 'local')`, id)
			return err
		}); err != nil {
			return err
		}
		committed <- o.OrderID
		<-ctx.Done() // a call to a cache, a log flush: whatever comes after
		return fmt.Errorf("after the commit: %w", ctx.Err())
	})
	var deaths deathLog
	cfg := server.Config{Redis: b.redis, Pool: b.pool, Concurrency: 5, ShutdownTimeout: 200 * time.Millisecond}
	cfg.Relay.PollInterval = 100 * time.Millisecond
	cfg.Guard.OnDead = deaths.onDead
	srv, err := server.New(cfg, mux)
	require.NoError(t, err)
	runCtx, deploy := context.WithCancel(ctx)
	stopped := make(chan error, 1)
	go func() { stopped <- srv.Run(runCtx) }()

	var ids []string
	for i := range 3 {
		res, err := b.client.Enqueue(ctx, committedThenCut.New(order{OrderID: fmt.Sprintf("cut-%d", i)}))
		require.NoError(t, err)
		ids = append(ids, res.Job.ID)
	}
	for range ids {
		<-committed
	}
	deploy()
	require.NoError(t, <-stopped)
	for _, id := range ids {
		j, err := b.store.Get(ctx, id)
		require.NoError(t, err)
		require.Equal(t, idempotency.StatusSucceeded, j.Status, "a deploy after the completing InTx made %+v", j)
	}
	require.Zero(t, deaths.n.Load(), "a deploy raised an alert")
}

// A handler whose completing InTx committed and which then fails is a dead
// letter however late it returns: hung past its deadline and grace, then
// failing, it is recorded as it would be before.
func TestAFailureAfterTheCompletingInTxIsRecordedHoweverLate(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	release := make(chan struct{})
	mux := tasks.NewMux()
	tasks.Handle(mux, committedThenHung, func(ctx context.Context, o order) error {
		if err := idempotency.InTx(ctx, func(tx pgx.Tx) error { return nil }); err != nil {
			return err
		}
		<-release // ignores its context, past deadline and grace
		return errors.New("the cache refresh after the commit failed")
	})
	var deaths deathLog
	srv := b.startWorker(t, mux, func(c *server.Config) {
		c.Guard.TimeoutGrace = 200 * time.Millisecond
		c.Guard.OnDead = deaths.onDead
	})
	res, err := b.client.Enqueue(ctx, committedThenHung.New(order{OrderID: "hung-after-commit"}))
	require.NoError(t, err)
	b.waitStatus(t, res.Job.ID, idempotency.StatusSucceeded, 10*time.Second)
	testenv.Eventually(t, 10*time.Second, func() bool { return srv.Guard().Stats().Overran == 1 },
		"the watchdog never saw the run outlive its deadline")
	close(release)
	j := b.waitStatus(t, res.Job.ID, idempotency.StatusDead, 10*time.Second)
	require.Contains(t, j.LastError, "the cache refresh after the commit failed")
	require.NotNil(t, j.EffectsCommittedAt)
	testenv.Eventually(t, 5*time.Second, func() bool { return deaths.n.Load() == 1 }, "no alert for the dead letter")
}

// Runs asynq cut short and keel released uncharged (Inspector.
// CancelProcessing, as the README says) do not count towards asynq's retry
// limit either: a MaxRetry(2) job cancelled six times mid-run (asynq's own
// limit is the ledger's plus AsynqRetryHeadroom) still has both retries
// when its first real attempts fail, and succeeds on its third.
func TestAsynqsCountDoesNotRetireAJobTheLedgerWouldRun(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	var runs atomic.Int32
	started := make(chan int32, 16)
	mux := tasks.NewMux()
	tasks.Handle(mux, cancelledOften, func(ctx context.Context, o order) error {
		n := runs.Add(1)
		started <- n
		switch {
		case n <= 6:
			<-ctx.Done()
			return ctx.Err()
		case n <= 8:
			return errors.New("the provider failed")
		}
		return nil
	})
	var deaths deathLog
	b.startWorker(t, mux, func(c *server.Config) { c.Guard.OnDead = deaths.onDead })
	insp := asynq.NewInspector(b.redis)
	defer insp.Close()
	res, err := b.client.Enqueue(ctx, cancelledOften.New(order{OrderID: "cancelled-often"}))
	require.NoError(t, err)
	for range 6 {
		<-started
		require.NoError(t, insp.CancelProcessing(res.Job.ID))
	}
	j := b.waitStatus(t, res.Job.ID, idempotency.StatusSucceeded, 30*time.Second)
	require.Equal(t, 3, j.Attempts, "the ledger counts the failures and the success, not the cancels")
	require.EqualValues(t, 9, runs.Load())
	require.Zero(t, deaths.n.Load())
}
