package tasks_test

import (
	"context"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/tasks"
)

func TestClientCancelsByIDAndByKeyWithAnAuditNote(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	res, err := b.client.Enqueue(ctx, keyedKind.New(keyed{Key: "by-id"}, tasks.Delay(time.Hour)))
	require.NoError(t, err)
	out, err := b.client.Cancel(ctx, res.Job.ID, tasks.CancelNote("duplicate order"))
	require.NoError(t, err)
	require.Equal(t, idempotency.StatusCancelled, out.Job.Status)
	require.Equal(t, tasks.DefaultCancelActor, out.Job.ResolvedBy)
	_, err = b.insp.GetTaskInfo(res.Job.Queue, res.Job.ID)
	require.ErrorIs(t, err, asynq.ErrTaskNotFound, "the client removes the task from Redis")

	res2, err := b.client.Enqueue(ctx, keyedKind.New(keyed{Key: "by-key"}, tasks.Delay(time.Hour)))
	require.NoError(t, err)
	out, err = b.client.CancelByKey(ctx, keyedKind.Name(), "by-key", tasks.CancelBy("billing-service"), tasks.CancelNote("refunded"))
	require.NoError(t, err)
	require.Equal(t, res2.Job.ID, out.Job.ID)
	entries, err := b.store.Audit(ctx, res2.Job.ID)
	require.NoError(t, err)
	require.Len(t, entries, 1)
	require.Equal(t, "cancel", entries[0].Action)
	require.Equal(t, "billing-service", entries[0].Actor)
	require.Equal(t, "refunded", entries[0].Note)

	again, err := b.client.Cancel(ctx, res2.Job.ID)
	require.NoError(t, err)
	require.True(t, again.AlreadyCancelled)

	_, err = b.client.CancelByKey(ctx, keyedKind.Name(), "nobody", tasks.CancelBy("x"))
	require.ErrorIs(t, err, idempotency.ErrNotFound)
	_, err = b.client.Cancel(ctx, res.Job.ID, tasks.CancelBy(""))
	require.ErrorIs(t, err, idempotency.ErrActorRequired)
}
