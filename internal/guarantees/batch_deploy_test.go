package guarantees_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/testenv"
	"github.com/keeljobs/keel/internal/testworker"
	"github.com/keeljobs/keel/server"
	"github.com/keeljobs/keel/tasks"
)

var member = tasks.Define[item]("hunt:member", tasks.MaxRetry(0), tasks.Key(func(i item) string { return i.ID }))

// A batch member whose handler succeeded while a producer's transaction
// held its batch's row (adding members to the open batch) waits to be
// recorded. A deploy then must not turn that success into a crash: the
// job must not be retired as a poison job, nor charged an attempt.
func TestADeployWhileAMembersCompletionWaitsForItsBatchCostsNothing(t *testing.T) {
	e := setupAlone(t)
	ctx := context.Background()
	var runs atomic.Int32
	mux := tasks.NewMux()
	tasks.Handle(mux, member, func(ctx context.Context, i item) error {
		runs.Add(1)
		return nil // its work outside InTx: the guard records the success
	})
	b, err := e.client.NewBatch(ctx, tasks.BatchSpec{Description: "deploy"})
	require.NoError(t, err)
	m1, err := e.client.Enqueue(ctx, member.New(item{ID: "m1"}, tasks.InBatch(b.ID)))
	require.NoError(t, err)

	// A producer adds a member to the open batch in a long transaction.
	tx, err := e.pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck
	_, err = e.client.EnqueueTx(ctx, tx, member.New(item{ID: "m2"}, tasks.InBatch(b.ID)))
	require.NoError(t, err)

	scfg := server.Config{Redis: e.redisOpt(), Pool: e.pool, Concurrency: 2, ShutdownTimeout: time.Second}
	srv, err := server.New(scfg, mux)
	require.NoError(t, err)
	wctx, stop := context.WithCancel(ctx)
	var runErr error
	stopped := make(chan struct{})
	go func() { runErr = srv.Run(wctx); close(stopped) }()
	t.Cleanup(func() { stop(); <-stopped })

	testenv.Eventually(t, 20*time.Second, func() bool {
		return runs.Load() == 1 && e.count(t, `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE '%keel_jobs%'`) > 0
	}, "the member's completion never waited for its batch")

	// The deploy.
	stop()
	<-stopped
	require.NoError(t, runErr)
	require.NoError(t, tx.Commit(ctx))

	testworker.RunServer(t, scfg, mux)
	var j idempotency.Job
	testenv.Eventually(t, 40*time.Second, func() bool {
		j, err = e.store.Get(ctx, m1.Job.ID)
		require.NoError(t, err)
		return j.Status == idempotency.StatusSucceeded || j.Status == idempotency.StatusDead
	}, "the member never ended")
	require.Equal(t, idempotency.StatusSucceeded, j.Status, "%s: %s", j.ErrorClass, j.LastError)
	require.LessOrEqual(t, j.Attempts, 1, "the deploy was charged to the job")
}
