package outbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/inspect"
	"github.com/keeljobs/keel/internal/asynqwire"
	"github.com/keeljobs/keel/outbox"
	"github.com/keeljobs/keel/tasks"
)

// A paused queue's job that Redis lost is published again only into a
// paused queue: when Redis loses everything after a pass checked the
// pauses, the pass puts the pause back before it publishes the job, or a
// worker would run a job of a paused queue.
func TestAPausedQueuesLostJobIsPublishedIntoAPausedQueue(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	rdb := redis.NewClient(&redis.Options{Addr: b.redis.Addr()})
	t.Cleanup(func() { rdb.Close() })
	ops, err := inspect.New(inspect.Config{Pool: b.pool, RedisClient: rdb})
	require.NoError(t, err)
	_, err = ops.PauseQueue(ctx, "low", "ops", "the warehouse is closed")
	require.NoError(t, err)
	c := b.client(t, b.opt)
	held, err := c.Enqueue(ctx, work.New(item{ID: "held"}, tasks.Queue("low")))
	require.NoError(t, err)
	_, err = b.pool.Exec(ctx, `UPDATE keel_jobs SET updated_at = now() - interval '1 hour', published_at = now() - interval '1 hour'`)
	require.NoError(t, err)

	r := newReconciler(t, outbox.ReconcilerConfig{Pool: b.pool, Redis: b.opt, Grace: time.Minute})
	defer r.Close()
	outbox.AfterPausesHook(r, func() { require.NoError(t, rdb.FlushAll(ctx).Err()) })
	n, err := r.Reconcile(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	require.Equal(t, int64(1), rdb.Exists(ctx, asynqwire.TaskKey("low", held.Job.ID)).Val(), "the job is published again")
	paused, err := asynqwire.Paused(ctx, rdb, "low")
	require.NoError(t, err)
	require.True(t, paused, "the job went into a queue Redis no longer held paused")
}
