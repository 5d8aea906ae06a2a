package tasks_test

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/inspect"
	"github.com/keeljobs/keel/internal/testenv"
	"github.com/keeljobs/keel/internal/testworker"
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
	entries, err := testworker.Ops(t, b.store, nil).Audit(ctx, res2.Job.ID)
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
	require.ErrorIs(t, err, inspect.ErrActorRequired)
}

// Cancels go through the client's own Redis connections: many of them open
// no new connection each (they used to build an inspector per call).
func TestCancelsReuseTheClientsConnections(t *testing.T) {
	rs := testenv.StartRedis(t)
	opt := asynq.RedisClientOpt{Addr: rs.Addr()}
	b := newBundle(t, opt, testenv.Pool(t, schema+"_cancel_conns"))
	ctx := context.Background()
	var ids []string
	for i := range 20 {
		res, err := b.client.Enqueue(ctx, keyedKind.New(keyed{Key: fmt.Sprint("conn-", i)}, tasks.Delay(time.Hour)))
		require.NoError(t, err)
		ids = append(ids, res.Job.ID)
	}
	rdb := redis.NewClient(&redis.Options{Addr: rs.Addr()})
	defer rdb.Close()
	received := func() int {
		info, err := rdb.Info(ctx, "stats").Result()
		require.NoError(t, err)
		for line := range strings.SplitSeq(info, "\r\n") {
			if v, ok := strings.CutPrefix(line, "total_connections_received:"); ok {
				n, err := strconv.Atoi(v)
				require.NoError(t, err)
				return n
			}
		}
		t.Fatal("no total_connections_received in INFO")
		return 0
	}
	before := received()
	for _, id := range ids {
		out, err := b.client.Cancel(ctx, id)
		require.NoError(t, err)
		require.Equal(t, idempotency.StatusCancelled, out.Job.Status)
	}
	require.Less(t, received()-before, 5, "20 cancels opened a connection each")
}
