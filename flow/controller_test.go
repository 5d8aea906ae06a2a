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

// leaseLeft is how long the slot's one holder has left by Redis's clock,
// which judges leases.
func leaseLeft(t *testing.T, rdb *redis.Client) time.Duration {
	t.Helper()
	ctx := context.Background()
	held, err := rdb.ZRangeWithScores(ctx, slotsKey, 0, -1).Result()
	require.NoError(t, err)
	require.Len(t, held, 1)
	now, err := rdb.Time(ctx).Result()
	require.NoError(t, err)
	return time.UnixMilli(int64(held[0].Score)).Sub(now)
}

// expireLease moves the slot's lease end into the past, as if its lease
// had run out without renewal: tests move the lease, not the clock, since
// Redis's clock judges leases.
func expireLease(t *testing.T, rdb *redis.Client) {
	t.Helper()
	ctx := context.Background()
	held, err := rdb.ZRange(ctx, slotsKey, 0, -1).Result()
	require.NoError(t, err)
	require.Len(t, held, 1)
	require.NoError(t, rdb.ZAddXX(ctx, slotsKey, redis.Z{Score: 1, Member: held[0]}).Err())
}

func TestHeldSlotIsRenewed(t *testing.T) {
	opt, rdb := setupRedis(t)
	const lease = time.Minute
	cfg := flow.Config{Rules: []flow.Rule{{Name: "reports", Concurrency: 1}}, Lease: lease, Hold: flow.NoHold}
	a, b := newController(t, opt, cfg), newController(t, opt, cfg)
	signals := flow.InitTestSignals(a)
	tick, every := flow.RenewByHand(a)
	ctx := context.Background()

	release, err := a.Acquire(ctx, "reports")
	require.NoError(t, err)
	require.Equal(t, lease/3, <-every, "renewed every third of a lease")
	// Three leases pass, the last one renewed just in time.
	for range 3 {
		expireLease(t, rdb)
		tick <- time.Now()
		require.NoError(t, signals.Renewed.Wait(t))
		require.Greater(t, leaseLeft(t, rdb), lease/2, "the renewal starts a whole lease")
	}
	_, err = b.Acquire(ctx, "reports")
	require.ErrorIs(t, err, flow.ErrNoSlot, "a slot whose holder lives must not expire")
	release()
	releaseB, err := b.Acquire(ctx, "reports")
	require.NoError(t, err)
	releaseB()
	require.Zero(t, a.Stats().LeasesLost)
}

// Redis loses the slots (a restart without persistence, a failover to a
// replica that missed them, a flush) while a job holds one: the holder's
// next renewal adds it back, as the slots have room, and a second job is
// then refused, where it had been let past the limit for the rest of the
// first one's run.
func TestSlotsRedisLostAreRebuiltByTheirHolders(t *testing.T) {
	opt, rdb := setupRedis(t)
	cfg := flow.Config{Rules: []flow.Rule{{Name: "reports", Concurrency: 1}}, Lease: time.Minute, Hold: flow.NoHold}
	a, b := newController(t, opt, cfg), newController(t, opt, cfg)
	signals := flow.InitTestSignals(a)
	tick, _ := flow.RenewByHand(a)
	ctx := context.Background()

	releaseA, err := a.Acquire(ctx, "reports")
	require.NoError(t, err)
	require.NoError(t, rdb.FlushDB(ctx).Err())
	tick <- time.Now()
	require.NoError(t, signals.Renewed.Wait(t), "the slot was counted lost")
	_, err = b.Acquire(ctx, "reports")
	require.ErrorIs(t, err, flow.ErrNoSlot, "a second slot, limit 1")
	require.Zero(t, a.Stats().LeasesLost)
	releaseA()
	releaseB, err := b.Acquire(ctx, "reports")
	require.NoError(t, err)
	releaseB()
}

// A holder whose slot Redis lost, and which new jobs filled before its
// renewal, counts its lease lost: it does not add its slot back past the
// limit.
func TestALostSlotIsNotAddedBackPastTheLimit(t *testing.T) {
	opt, rdb := setupRedis(t)
	cfg := flow.Config{Rules: []flow.Rule{{Name: "reports", Concurrency: 1}}, Lease: time.Minute, Hold: flow.NoHold}
	a, b := newController(t, opt, cfg), newController(t, opt, cfg)
	signals := flow.InitTestSignals(a)
	tick, _ := flow.RenewByHand(a)
	ctx := context.Background()

	releaseA, err := a.Acquire(ctx, "reports")
	require.NoError(t, err)
	defer releaseA()
	require.NoError(t, rdb.FlushDB(ctx).Err())
	releaseB, err := b.Acquire(ctx, "reports")
	require.NoError(t, err, "the lost slot went to b before a renewed")
	defer releaseB()
	tick <- time.Now()
	require.ErrorIs(t, signals.Renewed.Wait(t), flow.ErrLeaseLost)
	require.EqualValues(t, 1, a.Stats().LeasesLost)
	n, err := rdb.ZCard(ctx, slotsKey).Result()
	require.NoError(t, err)
	require.EqualValues(t, 1, n, "a's slot added back past the limit")
}

func TestDeadHoldersSlotComesBackAfterLease(t *testing.T) {
	opt, rdb := setupRedis(t)
	const lease = time.Minute
	cfg := flow.Config{Redis: opt, Rules: []flow.Rule{{Name: "reports", Concurrency: 1}}, Lease: lease, Hold: flow.NoHold}
	a, err := flow.New(cfg)
	require.NoError(t, err)
	b := newController(t, opt, cfg)
	ctx := context.Background()

	_, err = a.Acquire(ctx, "reports")
	require.NoError(t, err)
	// Closing without releasing is what a dead worker does: renewal stops.
	require.NoError(t, a.Close())
	_, err = b.Acquire(ctx, "reports")
	require.ErrorIs(t, err, flow.ErrNoSlot, "the dead holder's slot is held until its lease ends")
	left := leaseLeft(t, rdb)
	require.Greater(t, left, time.Duration(0))
	require.LessOrEqual(t, left, lease)

	expireLease(t, rdb)
	release, err := b.Acquire(ctx, "reports")
	require.NoError(t, err, "the slot comes back once its lease has run out")
	release()
}

func TestHoldWaitsForAFreedSlot(t *testing.T) {
	opt, _ := setupRedis(t)
	// The hold outlasts any slow host: the freed slot is taken within it.
	c := newController(t, opt, flow.Config{Rules: []flow.Rule{{Name: "reports", Concurrency: 1}}, Hold: time.Minute})
	signals := flow.InitTestSignals(c)
	ctx := context.Background()

	release, err := c.Acquire(ctx, "reports")
	require.NoError(t, err)
	got := make(chan error, 1)
	go func() {
		release2, err := c.Acquire(ctx, "reports")
		if err == nil {
			release2()
		}
		got <- err
	}()
	require.Equal(t, "reports", signals.Busy.Wait(t), "the second job found the slot taken and holds")
	release()
	require.NoError(t, <-got, "the freed slot was taken while holding")
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
	signals := flow.InitTestSignals(c)
	ctx := context.Background()

	release, err := c.Acquire(ctx, "reports")
	require.NoError(t, err)
	// Redis answers, but refuses the release.
	require.NoError(t, rdb.Do(ctx, "ACL", "SETUSER", "default", "-zrem").Err())
	release()
	require.EqualValues(t, 1, rdb.ZCard(ctx, slotsKey).Val())
	require.EqualValues(t, 1, c.Stats().RedisErrors)

	require.NoError(t, rdb.Do(ctx, "ACL", "SETUSER", "default", "+zrem").Err())
	require.Equal(t, "reports", signals.GivenBack.Wait(t), "the slot stays taken until its lease (30s) ends")
	require.Zero(t, rdb.ZCard(ctx, slotsKey).Val())
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
