package scaleout_test

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/testenv"
	"github.com/keeljobs/keel/internal/testworker"
	"github.com/keeljobs/keel/outbox"
	"github.com/keeljobs/keel/redisurl"
	"github.com/keeljobs/keel/server"
	"github.com/keeljobs/keel/tasks"
)

type job struct {
	N int `json:"n"`
}

var (
	critical = tasks.Define[job]("scale:critical", tasks.Queue("critical"), tasks.Key(func(j job) string { return fmt.Sprint(j.N) }))
	normal   = tasks.Define[job]("scale:default", tasks.Queue("default"), tasks.Key(func(j job) string { return fmt.Sprint(j.N) }))
	low      = tasks.Define[job]("scale:low", tasks.Queue("low"), tasks.Key(func(j job) string { return fmt.Sprint(j.N) }))
)

// flow runs two workers (each with its relay and reconciler) on redisURL,
// enqueues jobs of three kinds on three queues, half of them through
// EnqueueTx, and checks that every job ran exactly once and both workers
// shared the load.
func flow(t *testing.T, redisURL string) {
	opt, err := redisurl.Parse(redisURL)
	require.NoError(t, err)
	pool, _ := testenv.PrivatePool(t)
	ctx := context.Background()
	_, err = pool.Exec(ctx, `CREATE TABLE effects (job_id text PRIMARY KEY, worker int NOT NULL)`)
	require.NoError(t, err)

	var runs atomic.Int64
	mux := func(worker int) *tasks.Mux {
		m := tasks.NewMux()
		h := func(ctx context.Context, j job) error {
			runs.Add(1)
			time.Sleep(2 * time.Millisecond) // work, so that both workers take a share
			return idempotency.InTx(ctx, func(tx pgx.Tx) error {
				id, _ := idempotency.JobID(ctx)
				_, err := tx.Exec(ctx, `INSERT INTO effects (job_id, worker) VALUES ($1, $2)`, id, worker)
				return err
			})
		}
		tasks.Handle(m, critical, h)
		tasks.Handle(m, normal, h)
		tasks.Handle(m, low, h)
		return m
	}
	var servers []*server.Server
	for w := range 2 {
		servers = append(servers, startWorker(t, opt, pool, mux(w)))
	}

	c, err := tasks.NewClient(tasks.ClientConfig{Redis: opt, Pool: pool})
	require.NoError(t, err)
	defer c.Close()
	const n = 300
	for i := range n {
		kind := []*tasks.Kind[job]{critical, normal, low}[i%3]
		if i%2 == 0 {
			_, err = c.Enqueue(ctx, kind.New(job{N: i}))
		} else {
			err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				_, err := c.EnqueueTx(ctx, tx, kind.New(job{N: i}))
				return err
			})
		}
		require.NoError(t, err)
		// A duplicate of every tenth job: still one job.
		if i%10 == 0 {
			res, err := c.Enqueue(ctx, kind.New(job{N: i}))
			require.NoError(t, err)
			require.True(t, res.Existed)
		}
	}
	testenv.Eventually(t, 60*time.Second, func() bool {
		var done int
		require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM keel_jobs WHERE status = 'succeeded'`).Scan(&done))
		return done == n
	}, "not every job succeeded on %s", redisURL)
	var effects, perWorkerMin int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM effects`).Scan(&effects))
	require.Equal(t, n, effects)
	require.NoError(t, pool.QueryRow(ctx, `SELECT coalesce(min(c), 0) FROM (SELECT count(*) c FROM effects GROUP BY worker) s`).Scan(&perWorkerMin))
	require.Greater(t, perWorkerMin, 0, "one worker did all the work")
	// Nothing left in asynq could start a handler again.
	testenv.WaitAsynqIdle(t, opt, 30*time.Second, "critical", "default", "low")
	require.EqualValues(t, n, runs.Load(), "a handler ran twice")

	// The reconciler works on this Redis too: lose one job and get it back.
	lost, err := c.Enqueue(ctx, normal.New(job{N: 10_000}, tasks.Delay(time.Hour)))
	require.NoError(t, err)
	insp := asynq.NewInspector(opt)
	defer insp.Close()
	require.NoError(t, insp.DeleteTask("default", lost.Job.ID))
	_, err = pool.Exec(ctx, `UPDATE keel_jobs SET updated_at = now() - interval '1 hour' WHERE id = $1`, lost.Job.ID)
	require.NoError(t, err)
	// The workers' own reconcilers (a pass a second) bring it back.
	testenv.Eventually(t, 30*time.Second, func() bool {
		info, err := insp.GetTaskInfo("default", lost.Job.ID)
		return err == nil && info.State == asynq.TaskStateScheduled
	}, "the lost job was never published again on %s", redisURL)
	// The reconciler counts its repair after the publish lands: wait for
	// the count, not only for the task.
	republished := func() (n uint64) {
		for _, s := range servers {
			n += s.Reconciler().Stats().Republished
		}
		return n
	}
	testenv.Eventually(t, 10*time.Second, func() bool { return republished() > 0 }, "no reconciler counted the repair")
	require.EqualValues(t, 1, republished(), "one repair, by one reconciler")
}

func startWorker(t *testing.T, opt asynq.RedisConnOpt, pool *pgxpool.Pool, mux *tasks.Mux) *server.Server {
	t.Helper()
	return testworker.RunServer(t, server.Config{Redis: opt, Pool: pool, Concurrency: 10, ShutdownTimeout: 2 * time.Second,
		Relay:      outbox.RelayConfig{PollInterval: 100 * time.Millisecond},
		Reconciler: outbox.ReconcilerConfig{Interval: time.Second}}, mux)
}

func TestRedisCluster(t *testing.T) {
	t.Parallel()
	addrs := startCluster(t)
	flow(t, "redis-cluster://"+strings.Join(addrs, ","))
}

func TestRedisSentinel(t *testing.T) {
	t.Parallel()
	sentinel := startSentinel(t)
	flow(t, "redis-sentinel://"+sentinel+"?master=keel")
}
