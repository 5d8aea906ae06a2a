package outbox_test

import (
	"context"
	"sync"
	"testing"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/inspect"
	"github.com/keeljobs/keel/internal/asynqwire"
	"github.com/keeljobs/keel/outbox"
)

// A resume that races reconciler passes stays a resume: a pass that read
// the pause before the resume took it away must not put it back in Redis
// after the resume lifted it there, leaving the queue paused with no pause
// in the ledger that any pass would ever lift.
func TestAResumeRacingReconcilerPassesStaysResumed(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	r := b.reconciler(t)
	rdb := redis.NewClient(&redis.Options{Addr: b.redis.Addr()})
	t.Cleanup(func() { rdb.Close() })
	ops, err := inspect.New(inspect.Config{Pool: b.pool, RedisClient: rdb})
	require.NoError(t, err)

	stop := make(chan struct{})
	var wg sync.WaitGroup
	for range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				if err := outbox.ApplyPauses(ctx, r); err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	defer func() { close(stop); wg.Wait() }()

	for i := range 200 {
		_, err := ops.PauseQueue(ctx, "low", "ops", "")
		require.NoError(t, err)
		resumed, err := ops.ResumeQueue(ctx, "low", "ops", "")
		require.NoError(t, err)
		require.True(t, resumed)
		paused, err := asynqwire.Paused(ctx, rdb, "low")
		require.NoError(t, err)
		require.False(t, paused, "round %d: the queue is paused in Redis after its resume returned, and the ledger holds no pause", i)
	}
}
