package flow_test

import (
	"context"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/flow"
	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/testenv"
	"github.com/keeljobs/keel/tasks"
)

func TestConcurrencyLimitAcrossWorkerProcesses(t *testing.T) {
	b := setup(t)
	const limit, jobs = 3, 20
	// 20 worker goroutines in two processes for 20 jobs of 400ms behind 3
	// slots: at most 15 can start within the 2s hold, so some jobs are
	// postponed and come back.
	env := []string{childLimitEnv + "=3", childHoldEnv + "=2s"}
	w1, w2 := b.startChild(t, env...), b.startChild(t, env...)
	b.waitReady(t, 2)

	ids := make([]string, jobs)
	for i := range ids {
		ids[i] = b.enqueue(t, reportKind, Report{N: i, Sleep: 400 * time.Millisecond})
	}
	for _, id := range ids {
		j := b.waitStatus(t, id, idempotency.StatusSucceeded, 60*time.Second)
		require.Equal(t, 1, j.Attempts, "job %s: waiting for a slot must not use an attempt", id)
	}
	w1.stop(t)
	w2.stop(t)

	ctx := context.Background()
	maxRunning, err := b.rdb.Get(ctx, maxRunningKey).Int()
	require.NoError(t, err)
	require.Equal(t, limit, maxRunning, "at most %d at once, and the limit is used", limit)
	require.Equal(t, jobs, b.count(t, `SELECT count(*) FROM runs`), "each job ran once")
	require.Equal(t, 2, b.count(t, `SELECT count(DISTINCT pid) FROM runs`), "both processes ran jobs")

	stats, err := b.rdb.HGetAll(ctx, statsKey).Result()
	require.NoError(t, err)
	require.Equal(t, "20", stats["admitted"])
	require.NotEqual(t, "0", stats["no_slot"], "some jobs were postponed: %v", stats)
	require.Equal(t, "0", stats["leases_lost"])
}

func TestSlotOfKilledWorkerComesBack(t *testing.T) {
	b := setup(t)
	const lease = 2 * time.Second
	w := b.startChild(t, childLimitEnv+"=1", childLeaseEnv+"="+lease.String())
	b.waitReady(t, 1)
	ctx := context.Background()

	hung := b.enqueue(t, reportKind, Report{N: 1, Hang: true})
	b.waitStatus(t, hung, idempotency.StatusRunning, 15*time.Second)
	testenv.Eventually(t, 10*time.Second, func() bool {
		return b.count(t, `SELECT count(*) FROM runs WHERE job_id = $1`, hung) == 1
	}, "the hung job's handler never started")
	held, err := b.rdb.ZRangeWithScores(ctx, slotsKey, 0, -1).Result()
	require.NoError(t, err)
	require.Len(t, held, 1)
	require.True(t, strings.HasSuffix(held[0].Member.(string), "/"+hung), "the slot is the hung job's: %v", held)
	// The lease runs at least this long; renewals can only extend it.
	leaseEnd := time.UnixMilli(int64(held[0].Score))

	w.kill(t)
	killed := time.Now()
	require.Equal(t, int64(1), b.rdb.ZCard(ctx, slotsKey).Val(), "the dead worker's slot is held until its lease ends")

	limits := newController(t, b.redis, flow.Config{Rules: []flow.Rule{reportsRule(1)}, Lease: lease, Hold: 5 * time.Second})
	mux := tasks.NewMux()
	tasks.Handle(mux, reportKind, reportHandler(b.pool, b.rdb))
	b.startWorker(t, mux, limits)
	next := b.enqueue(t, reportKind, Report{N: 2})
	j := b.waitStatus(t, next, idempotency.StatusSucceeded, 20*time.Second)
	require.Equal(t, 1, j.Attempts)
	require.Less(t, time.Since(killed), 15*time.Second)

	var started time.Time
	require.NoError(t, b.pool.QueryRow(ctx, `SELECT started_at FROM runs WHERE job_id = $1`, next).Scan(&started))
	require.False(t, started.Before(leaseEnd.Add(-50*time.Millisecond)),
		"the next job started at %v, before the dead worker's lease ended at %v", started, leaseEnd)
	// asynq has not recovered the killed task (it takes about a minute): the
	// slot came back by its own lease.
	h, err := b.store.Get(ctx, hung)
	require.NoError(t, err)
	require.Equal(t, idempotency.StatusRunning, h.Status)
}

func TestRateLimitAcrossWorkers(t *testing.T) {
	b := setup(t)
	const rate, burst, jobs = 10, 2, 60
	rule := flow.Rule{Name: "mail-api", Kinds: []string{mailKind.Name()}, Rate: rate, Period: time.Second, Burst: burst}

	var mu sync.Mutex
	var starts []time.Time
	var controllers []*flow.Controller
	for range 2 {
		limits := newController(t, b.redis, flow.Config{Rules: []flow.Rule{rule}, Hold: 1500 * time.Millisecond})
		controllers = append(controllers, limits)
		mux := tasks.NewMux()
		tasks.Handle(mux, mailKind, func(context.Context, Report) error {
			mu.Lock()
			starts = append(starts, time.Now())
			mu.Unlock()
			return nil
		})
		b.startWorker(t, mux, limits)
	}

	ids := make([]string, jobs)
	for i := range ids {
		ids[i] = b.enqueue(t, mailKind, Report{N: i})
	}
	for _, id := range ids {
		j := b.waitStatus(t, id, idempotency.StatusSucceeded, 60*time.Second)
		require.Equal(t, 1, j.Attempts, "job %s: waiting for the rate must not use an attempt", id)
	}

	mu.Lock()
	defer mu.Unlock()
	require.Len(t, starts, jobs)
	sort.Slice(starts, func(i, j int) bool { return starts[i].Before(starts[j]) })
	// GCRA allows rate+burst-1 starts in any second; one more absorbs the
	// time between Redis granting a start and the handler noting it.
	busiest := 0
	for i := range starts {
		n := 0
		for j := i; j < len(starts) && starts[j].Sub(starts[i]) < time.Second; j++ {
			n++
		}
		require.LessOrEqual(t, n, rate+burst, "starts in the second from %v", starts[i].Sub(starts[0]))
		busiest = max(busiest, n)
	}
	var postponed uint64
	for _, c := range controllers {
		postponed += c.Stats().RateLimited
	}
	require.NotZero(t, postponed, "60 jobs on 20 goroutines holding 1.5s: some must have been postponed")
	t.Logf("%d jobs in %v, at most %d in a second, %d postponements", jobs, starts[len(starts)-1].Sub(starts[0]), busiest, postponed)
}
