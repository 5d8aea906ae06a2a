package guarantees_test

import (
	"context"
	"fmt"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/inspect"
	"github.com/keeljobs/keel/internal/testworker"
	"github.com/keeljobs/keel/retry"
	"github.com/keeljobs/keel/tasks"
)

// tenantItem is a job of one tenant; its ID says what its handler does.
type tenantItem struct {
	Tenant string `json:"tenant"`
	ID     string `json:"id"`
}

// tenantLimit jobs of one tenant may be in flight at once.
const tenantLimit = 2

var tenantKind = tasks.Define[tenantItem]("hunt:tenant", tasks.MaxRetry(3),
	tasks.Key(func(i tenantItem) string { return i.Tenant + "/" + i.ID }),
	tasks.ConcurrencyKey(func(i tenantItem) string { return i.Tenant }, tenantLimit))

// tenantHandlers record each run's start and end (clock_timestamp, across
// processes) in fair_runs. IDs starting "kill" SIGKILL their worker in
// their first run; "flaky" fail their first run (a retry keeps its slot);
// "doomed" die at once. Every other one takes a moment and succeeds.
func tenantHandlers(mux *tasks.Mux, pool *pgxpool.Pool) {
	tasks.Handle(mux, tenantKind, func(ctx context.Context, it tenantItem) error {
		id, _ := idempotency.JobID(ctx)
		var run int64
		if err := pool.QueryRow(ctx, `INSERT INTO fair_runs (job_id, tenant) VALUES ($1, $2) RETURNING run`,
			id, it.Tenant).Scan(&run); err != nil {
			return err
		}
		first := idempotency.Attempt(ctx) == 1
		switch {
		case strings.HasPrefix(it.ID, "kill") && first:
			_ = syscall.Kill(syscall.Getpid(), syscall.SIGKILL)
			select {}
		case strings.HasPrefix(it.ID, "doomed"):
			return retry.Permanent(fmt.Errorf("doomed"))
		}
		time.Sleep(30 * time.Millisecond)
		if _, err := pool.Exec(ctx, `UPDATE fair_runs SET ended_at = clock_timestamp() WHERE run = $1`, run); err != nil {
			return err
		}
		if strings.HasPrefix(it.ID, "flaky") && first {
			return fmt.Errorf("flaky")
		}
		return effect(ctx)
	})
}

// A tenant's flood never has more than its limit of jobs in Redis or in
// handlers, across two worker processes, through everything that ends or
// restarts a job: a worker killed with SIGKILL (its job keeps its slot
// while rescued), a retry (keeps it), a death and a cancel (give it
// back), Redis losing everything (the reconciler publishes only jobs in
// flight), a duplicate enqueue of a held job. Another tenant's job is
// published at once, and every job ends.
func TestATenantsFloodStaysWithinItsLimitAcrossWorkers(t *testing.T) {
	e := setup(t)
	ctx := context.Background()
	_, err := e.pool.Exec(ctx, `CREATE TABLE fair_runs (run bigserial PRIMARY KEY, job_id text, tenant text,
		started_at timestamptz DEFAULT clock_timestamp(), ended_at timestamptz)`)
	require.NoError(t, err)

	// The flood: two jobs take the slots, the rest are held, whichever way
	// they were enqueued.
	var flood []*tasks.Task
	for i := range 14 {
		id := fmt.Sprint("job", i)
		switch i {
		case 0:
			id = "kill"
		case 3:
			id = "doomed"
		case 5, 9:
			id = fmt.Sprint("flaky", i)
		}
		flood = append(flood, tenantKind.New(tenantItem{Tenant: "acme", ID: id}))
	}
	res, err := e.client.EnqueueMany(ctx, flood...)
	require.NoError(t, err)
	// One call admits in its rows' order (by business key).
	published := 0
	for i, r := range res {
		if r.Published {
			published++
		} else {
			require.True(t, r.Job.HeldForKey(), "job %d: %s", i, r.Job.Status)
		}
	}
	require.Equal(t, tenantLimit, published)
	one, err := e.client.Enqueue(ctx, tenantKind.New(tenantItem{Tenant: "acme", ID: "single"}))
	require.NoError(t, err)
	require.False(t, one.Published)
	require.NoError(t, pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error {
		_, err := e.client.EnqueueTx(ctx, tx, tenantKind.New(tenantItem{Tenant: "acme", ID: "in-tx"}))
		return err
	}))
	dup, err := e.client.Enqueue(ctx, tenantKind.New(tenantItem{Tenant: "acme", ID: "job7"}))
	require.NoError(t, err)
	require.True(t, dup.Existed)
	require.False(t, dup.Published)
	other, err := e.client.Enqueue(ctx, tenantKind.New(tenantItem{Tenant: "globex", ID: "single"}))
	require.NoError(t, err)
	require.True(t, other.Published, "another tenant's job waited behind the flood")

	ops := testworker.Ops(t, e.store, nil)
	var cancelled string
	for _, r := range res {
		if r.Job.HeldForKey() {
			cancelled = r.Job.ID
		}
	}
	_, err = ops.Cancel(ctx, cancelled, "ops", "customer withdrew it")
	require.NoError(t, err)

	rdb := redis.NewClient(&redis.Options{Addr: e.redis.Addr()})
	defer rdb.Close()
	inRedis := func() int64 {
		n, err := rdb.LLen(ctx, "asynq:{default}:pending").Result()
		require.NoError(t, err)
		return n
	}
	require.Equal(t, int64(tenantLimit+1), inRedis(), "Redis holds more than the flood's limit")
	keys, err := ops.ConcurrencyKeys(ctx, tenantKind.Name(), "", 10)
	require.NoError(t, err)
	require.Equal(t, []inspect.KeyCount{
		{Key: "acme", Limit: tenantLimit, InFlight: tenantLimit, Held: 13, OldestHeld: keys[0].OldestHeld},
		{Key: "globex", Limit: tenantLimit, InFlight: 1},
	}, keys)

	// Redis loses everything before any worker runs.
	require.NoError(t, rdb.FlushAll(ctx).Err())

	workers := []*child{e.startChild(t, "tenant"), e.startChild(t, "tenant")}
	settled := func() (bool, string) {
		left, err := ops.ConcurrencyKeys(ctx, tenantKind.Name(), "", 10)
		require.NoError(t, err)
		return len(left) == 0, fmt.Sprintf("%+v", left)
	}
	e.settle(t, "tenant", 90*time.Second, settled, workers...)

	// What ran: never more than the limit of a tenant at once, in the
	// handlers of both processes (a run that never recorded its end, the
	// killed one, counts until its job's next run started).
	require.Equal(t, 0, e.count(t, `SELECT count(*) FROM fair_runs a WHERE a.tenant = 'acme' AND (
		SELECT count(*) FROM fair_runs b WHERE b.tenant = a.tenant AND b.started_at <= a.started_at
			AND coalesce(b.ended_at, (SELECT min(c.started_at) FROM fair_runs c WHERE c.job_id = b.job_id AND c.run > b.run)) > a.started_at
		) > $1`, tenantLimit), "more than the limit of one tenant's jobs ran at once")
	require.Equal(t, 1, e.count(t, `SELECT count(*) FROM keel_jobs WHERE status = 'dead'`))
	require.Equal(t, 1, e.count(t, `SELECT count(*) FROM keel_jobs WHERE status = 'cancelled'`))
	require.Equal(t, 15, e.count(t, `SELECT count(*) FROM keel_jobs WHERE status = 'succeeded'`))
	require.Equal(t, 15, e.count(t, `SELECT count(DISTINCT job_id) FROM effects`))
	require.Equal(t, 0, e.count(t, `SELECT count(*) FROM fair_runs r JOIN keel_jobs j ON j.id = r.job_id WHERE j.status = 'cancelled'`))
}
