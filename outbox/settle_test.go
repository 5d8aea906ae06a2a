package outbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/stretchr/testify/require"
)

// After a Redis failover asynq may keep a task active on the new master
// for minutes although its worker finished it (the acknowledgement was
// lost with the old master). A reconciler pass settles such copies of jobs
// the ledger has finished; a task fetched a moment ago, and the copy of a
// job still open, are left alone.
func TestSettleRemovesFinishedJobsAsynqStillShowsRunning(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	c := b.client(t, b.opt)
	insp := asynq.NewInspector(b.opt)
	defer insp.Close()
	done, err := c.Enqueue(ctx, work.New(item{ID: "acknowledgement-lost"}))
	require.NoError(t, err)
	b.fetchAsDeadWorker(t, 20*time.Second)
	open, err := c.Enqueue(ctx, work.New(item{ID: "still-open"}))
	require.NoError(t, err)
	b.fetchAsDeadWorker(t, 20*time.Second)
	fresh, err := c.Enqueue(ctx, work.New(item{ID: "just-fetched"}))
	require.NoError(t, err)
	b.fetchAsDeadWorker(t, 0)
	_, err = b.pool.Exec(ctx, `UPDATE keel_jobs SET status = 'succeeded', finished_at = now() WHERE id = ANY($1)`,
		[]string{done.Job.ID, fresh.Job.ID})
	require.NoError(t, err)

	r := b.reconciler(t)
	n, err := r.SettleFinished(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	_, err = insp.GetTaskInfo("default", done.Job.ID)
	require.ErrorIs(t, err, asynq.ErrTaskNotFound, "a finished job still shows as running")
	require.Equal(t, asynq.TaskStateActive, b.state(t, insp, open.Job.ID), "an open job's copy was settled")
	require.Equal(t, asynq.TaskStateActive, b.state(t, insp, fresh.Job.ID), "a task fetched a moment ago was settled")
	q, err := insp.GetQueueInfo("default")
	require.NoError(t, err)
	require.Equal(t, 2, q.Active)
	require.EqualValues(t, 1, r.Stats().Settled)
}
