package guarantees_test

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/testworker"
	"github.com/keeljobs/keel/tasks"
)

// fairnessBenchEnv turns TestFairnessFigure on: it takes a minute and
// measures, so CI does not run it.
const fairnessBenchEnv = "KEEL_FAIRNESS_BENCH"

const (
	benchFlood      = 10000
	benchRun        = 20 * time.Millisecond
	benchWorkers    = 2
	benchConcurrent = 10
)

// fairKind is limited per tenant; floodKind is the same work without a
// limit, for comparison.
var (
	fairKind = tasks.Define[tenantItem]("hunt:fair", tasks.MaxRetry(3),
		tasks.Key(func(i tenantItem) string { return i.Tenant + "/" + i.ID }),
		tasks.ConcurrencyKey(func(i tenantItem) string { return i.Tenant }, tenantLimit))
	floodKind = tasks.Define[tenantItem]("hunt:flood", tasks.MaxRetry(3),
		tasks.Key(func(i tenantItem) string { return i.Tenant + "/" + i.ID }))
)

// benchHandlers record when each of tenant b's jobs starts, then work for
// benchRun.
func benchHandlers(mux *tasks.Mux, pool *pgxpool.Pool) {
	h := func(ctx context.Context, it tenantItem) error {
		if it.Tenant == "b" {
			if err := started(ctx, pool); err != nil {
				return err
			}
		}
		time.Sleep(benchRun)
		return nil
	}
	tasks.Handle(mux, fairKind, h)
	tasks.Handle(mux, floodKind, h)
}

// TestFairnessFigure is BENCHMARKS.md's fair-shares figure: tenant a
// enqueues benchFlood jobs, then tenant b one; how long b's job waits from
// its enqueue to its start, against its own run time, on benchWorkers
// worker processes of benchConcurrent each. With the kind's concurrency
// key (limit tenantLimit) and, for comparison, without one, and with no
// flood at all: keel's own latency from enqueue to start, which the flood's
// delay is on top of.
func TestFairnessFigure(t *testing.T) {
	if os.Getenv(fairnessBenchEnv) == "" {
		t.Skipf("set %s=1 to measure fair shares (about a minute)", fairnessBenchEnv)
	}
	for _, c := range []struct {
		k     *tasks.Kind[tenantItem]
		flood int
	}{{fairKind, benchFlood}, {floodKind, benchFlood}, {fairKind, 0}} {
		k := c.k
		name := strings.TrimPrefix(k.Name(), "hunt:")
		if c.flood == 0 {
			name = "alone"
		}
		t.Run(name, func(t *testing.T) {
			e := setupAlone(t)
			ctx := context.Background()
			for range benchWorkers {
				e.startChild(t, "fair-bench")
			}
			start := time.Now()
			flood := make([]*tasks.Task, 0, c.flood)
			for i := range c.flood {
				flood = append(flood, k.New(tenantItem{Tenant: "a", ID: fmt.Sprint(i)}))
			}
			if len(flood) > 0 {
				_, err := e.client.EnqueueMany(ctx, flood...)
				require.NoError(t, err)
			} else {
				// Workers up and idle, as the flood's find them.
				_, err := e.client.Enqueue(ctx, k.New(tenantItem{Tenant: "warm", ID: "up"}))
				require.NoError(t, err)
				testworker.WaitStatus(t, e.store, mustLookup(t, e, k.Name(), "warm/up"), idempotency.StatusSucceeded, time.Minute)
			}
			enqueued := time.Since(start)
			b, err := e.client.Enqueue(ctx, k.New(tenantItem{Tenant: "b", ID: "single"}))
			require.NoError(t, err)
			testworker.WaitStatus(t, e.store, b.Job.ID, idempotency.StatusSucceeded, 5*time.Minute)
			var wait time.Duration
			require.NoError(t, e.pool.QueryRow(ctx, `SELECT s.at - j.created_at FROM started s JOIN keel_jobs j ON j.id = s.job_id
				WHERE s.job_id = $1 ORDER BY s.at LIMIT 1`, b.Job.ID).Scan(&wait))
			var doneA int
			require.NoError(t, e.pool.QueryRow(ctx, `SELECT count(*) FROM keel_jobs WHERE kind = $1 AND status = 'succeeded'`, k.Name()).Scan(&doneA))
			t.Logf("%s: %d jobs of tenant a enqueued in %s; tenant b's job waited %s from enqueue to start = %.2f× its run time (%s); "+
				"%d of a's jobs had finished by then; %d workers × concurrency %d",
				name, c.flood, enqueued.Round(time.Millisecond), wait.Round(time.Millisecond),
				float64(wait)/float64(benchRun), benchRun, doneA-1, benchWorkers, benchConcurrent)
		})
	}
}

func mustLookup(t *testing.T, e *env, kind, key string) string {
	t.Helper()
	j, err := e.store.Lookup(context.Background(), kind, key)
	require.NoError(t, err)
	return j.ID
}
