package wake_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/jobstore"
	"github.com/keeljobs/keel/internal/testenv"
	"github.com/keeljobs/keel/internal/testworker"
	"github.com/keeljobs/keel/retry"
	"github.com/keeljobs/keel/server"
	"github.com/keeljobs/keel/tasks"
)

type ping struct {
	ID string `json:"id"`
}

var pingKind = tasks.Define[ping]("wake:ping", tasks.Key(func(p ping) string { return p.ID }))

// An idle worker waits for work instead of polling for it, and starts what
// keel announces at once: a job enqueued, and a retry its own forwarder
// moves into the queue. With IdleWait at a minute, nothing but the
// announcement can have started them within the test's time.
func TestAnIdleWorkerStartsAnnouncedWorkAtOnce(t *testing.T) {
	rs := testenv.StartRedis(t)
	opt := asynq.RedisClientOpt{Addr: rs.Addr()}
	pool := testenv.Pool(t, "keel_test_wake")
	ctx := context.Background()
	var retried atomic.Int32
	mux := tasks.NewMux()
	tasks.Handle(mux, pingKind, func(ctx context.Context, p ping) error {
		if p.ID == "retried" && retried.Add(1) == 1 {
			return retry.After(time.Second, errors.New("not yet"))
		}
		return nil
	})
	cfg := server.Config{Redis: opt, Pool: pool, IdleWait: time.Minute, DisableReconciler: true}
	cfg.Retry.Base, cfg.Retry.Cap = time.Second, time.Second
	srv := testworker.RunServer(t, cfg, mux)
	c, err := tasks.NewClient(tasks.ClientConfig{Redis: opt, Pool: pool})
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	store := jobstore.NewStore(pool)

	testenv.Eventually(t, 10*time.Second, func() bool { return srv.IdleWaits() > 0 }, "the idle worker never waited")
	res, err := c.Enqueue(ctx, pingKind.New(ping{ID: "announced"}))
	require.NoError(t, err)
	testworker.WaitStatus(t, store, res.Job.ID, idempotency.StatusSucceeded, 20*time.Second)

	// Its first run fails; the worker goes idle and waits; its retry comes
	// back through the forwarder, which announces nothing on the channel.
	res, err = c.Enqueue(ctx, pingKind.New(ping{ID: "retried"}))
	require.NoError(t, err)
	testworker.WaitStatus(t, store, res.Job.ID, idempotency.StatusSucceeded, 20*time.Second)
	require.EqualValues(t, 2, retried.Load())
}

// Work nobody announced (a plain asynq client's task) still starts, IdleWait
// later at most.
func TestAnIdleWorkerFindsUnannouncedWorkAfterIdleWait(t *testing.T) {
	rs := testenv.StartRedis(t)
	opt := asynq.RedisClientOpt{Addr: rs.Addr()}
	pool := testenv.Pool(t, "keel_test_wake")
	srv := testworker.RunServer(t, server.Config{Redis: opt, Pool: pool, IdleWait: 300 * time.Millisecond, DisableReconciler: true}, tasks.NewMux())
	testenv.Eventually(t, 10*time.Second, func() bool { return srv.IdleWaits() > 0 }, "the idle worker never waited")
	ac := asynq.NewClient(opt)
	defer ac.Close()
	info, err := ac.Enqueue(asynq.NewTask("wake:foreign", nil), asynq.MaxRetry(0))
	require.NoError(t, err)
	insp := asynq.NewInspector(opt)
	defer insp.Close()
	testenv.Eventually(t, 20*time.Second, func() bool {
		ti, err := insp.GetTaskInfo(info.Queue, info.ID)
		return err == nil && ti.State != asynq.TaskStatePending
	}, "the worker never took the unannounced task")
}
