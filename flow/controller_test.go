package flow_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/flow"
	"github.com/keeljobs/keel/internal/testenv"
	"github.com/keeljobs/keel/retry"
)

// requireWait checks that err postpones the job (no attempt used) because of
// cause (when not nil), after a delay within [lo, hi].
func requireWait(t *testing.T, err error, cause error, lo, hi time.Duration) {
	t.Helper()
	require.Error(t, err)
	require.True(t, retry.IsWait(err), "not a wait: %v", err)
	require.Equal(t, retry.ClassWait, retry.Classify(err))
	require.False(t, retry.IsFailure(err))
	if cause != nil {
		require.ErrorIs(t, err, cause)
	}
	e, ok := retry.Marked(err)
	require.True(t, ok)
	require.GreaterOrEqual(t, e.Delay, lo, "delay")
	require.LessOrEqual(t, e.Delay, hi, "delay")
}

func TestSlotsAreSharedAcrossControllers(t *testing.T) {
	opt, rdb := setupRedis(t)
	cfg := flow.Config{Rules: []flow.Rule{{Name: "reports", Concurrency: 2}}, Hold: flow.NoHold, Recheck: 2 * time.Second}
	a, b := newController(t, opt, cfg), newController(t, opt, cfg)
	ctx := context.Background()

	release1, err := a.Acquire(ctx, "reports")
	require.NoError(t, err)
	release2, err := b.Acquire(ctx, "reports")
	require.NoError(t, err)
	_, err = a.Acquire(ctx, "reports")
	requireWait(t, err, flow.ErrNoSlot, time.Second, 3*time.Second)
	_, err = b.Acquire(ctx, "reports")
	requireWait(t, err, flow.ErrNoSlot, time.Second, 3*time.Second)
	require.Equal(t, int64(2), rdb.ZCard(ctx, slotsKey).Val())

	release1()
	release1() // idempotent: must not free a slot it no longer holds
	require.Equal(t, int64(1), rdb.ZCard(ctx, slotsKey).Val())
	release3, err := b.Acquire(ctx, "reports")
	require.NoError(t, err)
	release2()
	release3()
	require.Equal(t, int64(0), rdb.ZCard(ctx, slotsKey).Val())
	require.Equal(t, uint64(1), a.Stats().NoSlot)
	require.Equal(t, uint64(1), b.Stats().NoSlot)
}

func TestHeldSlotIsRenewed(t *testing.T) {
	opt, _ := setupRedis(t)
	cfg := flow.Config{Rules: []flow.Rule{{Name: "reports", Concurrency: 1}}, Lease: 300 * time.Millisecond, Hold: flow.NoHold}
	a, b := newController(t, opt, cfg), newController(t, opt, cfg)
	ctx := context.Background()

	release, err := a.Acquire(ctx, "reports")
	require.NoError(t, err)
	time.Sleep(time.Second) // three leases
	_, err = b.Acquire(ctx, "reports")
	require.ErrorIs(t, err, flow.ErrNoSlot, "a slot whose holder lives must not expire")
	release()
	releaseB, err := b.Acquire(ctx, "reports")
	require.NoError(t, err)
	releaseB()
	require.Zero(t, a.Stats().LeasesLost)
}

func TestDeadHoldersSlotComesBackAfterLease(t *testing.T) {
	opt, _ := setupRedis(t)
	const lease = 500 * time.Millisecond
	cfg := flow.Config{Redis: opt, Rules: []flow.Rule{{Name: "reports", Concurrency: 1}}, Lease: lease, Hold: 5 * time.Second}
	a, err := flow.New(cfg)
	require.NoError(t, err)
	b := newController(t, opt, cfg)
	ctx := context.Background()

	_, err = a.Acquire(ctx, "reports")
	require.NoError(t, err)
	// Closing without releasing is what a dead worker does: renewal stops.
	require.NoError(t, a.Close())
	dead := time.Now()
	release, err := b.Acquire(ctx, "reports")
	require.NoError(t, err, "b holds up to 5s, far longer than the lease")
	release()
	// The slot was free only once the lease (renewed at most a third of a
	// lease before the holder died) had run out.
	require.GreaterOrEqual(t, time.Since(dead), lease*2/3-50*time.Millisecond)
}

func TestHoldWaitsForAFreedSlot(t *testing.T) {
	opt, _ := setupRedis(t)
	c := newController(t, opt, flow.Config{Rules: []flow.Rule{{Name: "reports", Concurrency: 1}}, Hold: 3 * time.Second})
	ctx := context.Background()

	release, err := c.Acquire(ctx, "reports")
	require.NoError(t, err)
	time.AfterFunc(300*time.Millisecond, release)
	start := time.Now()
	release2, err := c.Acquire(ctx, "reports")
	require.NoError(t, err)
	release2()
	require.Less(t, time.Since(start), 2*time.Second, "the freed slot was taken while holding")
}

func TestHoldEndsAtTheJobsDeadline(t *testing.T) {
	opt, _ := setupRedis(t)
	c := newController(t, opt, flow.Config{Rules: []flow.Rule{{Name: "reports", Concurrency: 1}}, Hold: 10 * time.Second})

	release, err := c.Acquire(context.Background(), "reports")
	require.NoError(t, err)
	defer release()
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err = c.Acquire(ctx, "reports")
	requireWait(t, err, flow.ErrNoSlot, time.Second, 3*time.Second)
	require.Less(t, time.Since(start), 2*time.Second)
}

func TestTakeSpacesStartsByTheRate(t *testing.T) {
	opt, _ := setupRedis(t)
	c := newController(t, opt, flow.Config{Rules: []flow.Rule{{Name: "mail", Rate: 10}}, Hold: 2 * time.Second})
	ctx := context.Background()

	var starts []time.Time
	for range 5 {
		require.NoError(t, c.Take(ctx, "mail"))
		starts = append(starts, time.Now())
	}
	// Burst 1: one start per 100ms. Sleeps only ever run late, so each gap
	// is at least the interval less the spread of Redis round trips.
	for i := 1; i < len(starts); i++ {
		require.GreaterOrEqual(t, starts[i].Sub(starts[i-1]), 80*time.Millisecond, "start %d", i)
	}
	require.GreaterOrEqual(t, starts[4].Sub(starts[0]), 380*time.Millisecond)
}

func TestTakeBeyondHoldIsAWait(t *testing.T) {
	opt, _ := setupRedis(t)
	c := newController(t, opt, flow.Config{
		Rules:   []flow.Rule{{Name: "mail", Rate: 1, Period: 10 * time.Second, Burst: 2}},
		Hold:    flow.NoHold,
		Recheck: 2 * time.Second,
	})
	ctx := context.Background()

	require.NoError(t, c.Take(ctx, "mail"))
	require.NoError(t, c.Take(ctx, "mail"), "burst 2: two starts at once")
	err := c.Take(ctx, "mail")
	// The next start is due 10s after the first; jitter adds up to Recheck/2.
	requireWait(t, err, flow.ErrRateLimited, 9*time.Second, 11*time.Second)
	require.ErrorContains(t, err, `"mail": over 1 per 10s`)
	require.Equal(t, uint64(1), c.Stats().RateLimited)
}

func TestTakeAndAcquireNeedTheirLimit(t *testing.T) {
	opt, _ := setupRedis(t)
	c := newController(t, opt, flow.Config{Rules: []flow.Rule{
		{Name: "mail", Rate: 1},
		{Name: "reports", Concurrency: 1},
	}})
	ctx := context.Background()

	require.ErrorIs(t, c.Take(ctx, "nope"), flow.ErrUnknownRule)
	require.ErrorIs(t, c.Take(ctx, "reports"), flow.ErrUnknownRule)
	_, err := c.Acquire(ctx, "mail")
	require.ErrorIs(t, err, flow.ErrUnknownRule)
	require.False(t, retry.IsWait(err), "a wrong name is a bug, not a reason to wait")
}

func TestUnreachableRedisPostpones(t *testing.T) {
	t.Parallel()
	c := newController(t, asynq.RedisClientOpt{Addr: "127.0.0.1:1", DialTimeout: time.Second},
		flow.Config{Rules: []flow.Rule{{Name: "mail", Rate: 1}}})
	err := c.Take(context.Background(), "mail")
	requireWait(t, err, nil, time.Second, 3*time.Second)
	require.ErrorContains(t, err, `"mail": take rate token`)
	require.Equal(t, uint64(1), c.Stats().RedisErrors)
}

func TestMiddleware(t *testing.T) {
	opt, rdb := setupRedis(t)
	c := newController(t, opt, flow.Config{
		Rules: []flow.Rule{
			{Name: "reports", Kinds: []string{"report:generate", "report:export"}, Concurrency: 1},
			{Name: "export-rate", Kinds: []string{"report:export"}, Rate: 1, Period: time.Minute, Burst: 2},
		},
		Hold: flow.NoHold,
	})
	ctx := context.Background()

	entered, leave := make(chan struct{}), make(chan struct{})
	h := c.Middleware(asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
		if t.Type() == "report:generate" {
			close(entered)
			<-leave
		}
		return nil
	}))

	require.NoError(t, h.ProcessTask(ctx, asynq.NewTask("other", nil)), "kinds no rule names pass")

	var wg sync.WaitGroup
	var first error
	wg.Go(func() { first = h.ProcessTask(ctx, asynq.NewTask("report:generate", nil)) })
	<-entered
	err := h.ProcessTask(ctx, asynq.NewTask("report:export", nil))
	require.ErrorIs(t, err, flow.ErrNoSlot, "the group's one slot is taken")
	require.Equal(t, int64(1), rdb.ZCard(ctx, slotsKey).Val())
	close(leave)
	wg.Wait()
	require.NoError(t, first)
	require.Equal(t, int64(0), rdb.ZCard(ctx, slotsKey).Val(), "the slot is given back when the handler returns")

	// export needs a slot and a start of its rate: two starts, then a wait.
	require.NoError(t, h.ProcessTask(ctx, asynq.NewTask("report:export", nil)))
	require.NoError(t, h.ProcessTask(ctx, asynq.NewTask("report:export", nil)))
	err = h.ProcessTask(ctx, asynq.NewTask("report:export", nil))
	require.ErrorIs(t, err, flow.ErrRateLimited)
	require.True(t, retry.IsWait(err))
	require.Equal(t, int64(0), rdb.ZCard(ctx, slotsKey).Val(), "a slot taken before the rate said no is given back")

	st := c.Stats()
	require.Equal(t, uint64(3), st.Admitted)
	require.Equal(t, uint64(1), st.NoSlot)
	require.Equal(t, uint64(1), st.RateLimited)
}

func TestMiddlewareWaitKeepsAttempts(t *testing.T) {
	// The retry middleware outside flow's passes its waits through
	// unchanged, so asynq is told they are no failure.
	opt, _ := setupRedis(t)
	c := newController(t, opt, flow.Config{Rules: []flow.Rule{{Name: "mail", Kinds: []string{"mail:send"}, Rate: 1, Period: time.Minute}}, Hold: flow.NoHold})
	h := retry.Policy{}.Middleware(nil)(c.Middleware(asynq.HandlerFunc(func(context.Context, *asynq.Task) error { return nil })))
	ctx := context.Background()
	require.NoError(t, h.ProcessTask(ctx, asynq.NewTask("mail:send", nil)))
	err := h.ProcessTask(ctx, asynq.NewTask("mail:send", nil))
	require.False(t, retry.IsFailure(err))
	require.False(t, errors.Is(err, asynq.SkipRetry))
	require.Greater(t, retry.Policy{}.Delay("mail:send", 0, err), 50*time.Second)
}

// A slot whose release Redis refused (a failover, a restart) is given back
// once Redis answers again, not only when its lease runs out: after a
// failover the new master holds the slots every running job had, and each
// would stay taken for a whole lease.
func TestFailedReleaseIsRetried(t *testing.T) {
	srv := testenv.StartRedis(t) // its own server: the test changes its ACL
	opt := asynq.RedisClientOpt{Addr: srv.Addr()}
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr()})
	defer rdb.Close()
	c := newController(t, opt, flow.Config{Rules: []flow.Rule{{Name: "reports", Concurrency: 1}}, Hold: flow.NoHold})
	ctx := context.Background()

	release, err := c.Acquire(ctx, "reports")
	require.NoError(t, err)
	// Redis answers, but refuses the release.
	require.NoError(t, rdb.Do(ctx, "ACL", "SETUSER", "default", "-zrem").Err())
	release()
	require.EqualValues(t, 1, rdb.ZCard(ctx, slotsKey).Val())
	require.EqualValues(t, 1, c.Stats().RedisErrors)

	require.NoError(t, rdb.Do(ctx, "ACL", "SETUSER", "default", "+zrem").Err())
	testenv.Eventually(t, 5*time.Second, func() bool { return rdb.ZCard(ctx, slotsKey).Val() == 0 },
		"the slot stayed taken until its lease (30s) ends")
	again, err := c.Acquire(ctx, "reports")
	require.NoError(t, err)
	again()
}

// Close does not wait for a release that keeps failing: the lease frees the
// slot.
func TestCloseStopsRetryingARelease(t *testing.T) {
	srv := testenv.StartRedis(t)
	opt := asynq.RedisClientOpt{Addr: srv.Addr()}
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr()})
	defer rdb.Close()
	c, err := flow.New(flow.Config{Redis: opt, Rules: []flow.Rule{{Name: "reports", Concurrency: 1}}, Hold: flow.NoHold})
	require.NoError(t, err)
	release, err := c.Acquire(context.Background(), "reports")
	require.NoError(t, err)
	require.NoError(t, rdb.Do(context.Background(), "ACL", "SETUSER", "default", "-zrem").Err())
	release()
	closed := make(chan error, 1)
	go func() { closed <- c.Close() }()
	select {
	case err := <-closed:
		require.NoError(t, err)
	case <-time.After(5 * time.Second):
		t.Fatal("Close waited for a release Redis keeps refusing")
	}
}
