package scaleout_test

import (
	"context"
	"fmt"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	flowlimit "github.com/keeljobs/keel/flow"
	"github.com/keeljobs/keel/internal/testenv"
	"github.com/keeljobs/keel/internal/testworker"
	"github.com/keeljobs/keel/outbox"
	"github.com/keeljobs/keel/redisurl"
	"github.com/keeljobs/keel/server"
	"github.com/keeljobs/keel/tasks"
)

var crossSlotStat = regexp.MustCompile(`errorstat_CROSSSLOT:count=(\d+)`)

// noCrossSlot fails if any node of the cluster refused a command for keys
// in several slots: keel's own errors may be retried or logged, but Redis
// counts every refusal.
func noCrossSlot(t *testing.T, addrs ...string) {
	t.Helper()
	for _, a := range addrs {
		n := redis.NewClient(&redis.Options{Addr: a})
		stats, err := n.Info(context.Background(), "errorstats").Result()
		n.Close()
		require.NoError(t, err, "INFO errorstats on %s", a)
		if m := crossSlotStat.FindStringSubmatch(stats); m != nil {
			t.Fatalf("node %s refused %s command(s) with CROSSSLOT", a, m[1])
		}
	}
}

// Every Redis command keel runs itself (not through asynq's client, server or
// inspector; the list is in the package comment) works on a cluster: each
// script's keys share one slot, and pipelines of keys in several slots go
// to the right nodes. The queues and rules are spread over the masters.
func TestKeelRedisCommandsOnCluster(t *testing.T) {
	t.Parallel()
	needRedisTools(t)
	addrs := startCluster(t)
	opt, err := redisurl.Parse("redis-cluster://" + strings.Join(addrs, ","))
	require.NoError(t, err)
	pool, _ := testenv.PrivatePool(t)
	ctx := context.Background()
	rdb := opt.MakeRedisClient().(redis.UniversalClient)
	defer rdb.Close()
	slots := map[int64]bool{}
	for _, q := range []string{"critical", "default", "low"} {
		s, err := rdb.ClusterKeySlot(ctx, "{"+q+"}").Result()
		require.NoError(t, err)
		slots[s] = true
	}
	require.Len(t, slots, 3, "the test's queues should hash to three slots")

	t.Run("flow", func(t *testing.T) {
		var rules []flowlimit.Rule
		for i := range 4 {
			rules = append(rules, flowlimit.Rule{Name: fmt.Sprint("crossslot-", i), Concurrency: 2, Rate: 1000})
		}
		// Renewed every 500 ms, each renewal given as long: a shorter lease
		// ran out on a busy host before its first renewal came back.
		limits, err := flowlimit.New(flowlimit.Config{Redis: opt, Rules: rules, Lease: 1500 * time.Millisecond})
		require.NoError(t, err)
		defer limits.Close()
		for _, r := range rules {
			release, err := limits.Acquire(ctx, r.Name) // acquire script
			require.NoError(t, err)
			// Wait for the renew script to move the lease on.
			key := "keel:flow:{" + r.Name + "}:slots"
			first, err := rdb.ZRangeWithScores(ctx, key, 0, 0).Result()
			require.NoError(t, err)
			require.Len(t, first, 1)
			testenv.Eventually(t, 5*time.Second, func() bool {
				now, err := rdb.ZRangeWithScores(ctx, key, 0, 0).Result()
				return err == nil && len(now) == 1 && now[0].Score > first[0].Score
			}, "the lease of %s was never renewed", r.Name)
			release() // ZREM
			require.Zero(t, rdb.ZCard(ctx, key).Val())
			require.NoError(t, limits.Take(ctx, r.Name)) // reserve script
		}
		require.Zero(t, limits.Stats().RedisErrors)
	})

	t.Run("rescue and reconcile", func(t *testing.T) {
		c, err := tasks.NewClient(tasks.ClientConfig{Redis: opt, Pool: pool})
		require.NoError(t, err)
		defer c.Close()
		insp := asynq.NewInspector(opt)
		defer insp.Close()
		// A live server, so that the rescuer reads asynq's worker lists. It
		// serves another queue and leaves the test's tasks alone.
		testworker.RunServer(t, server.Config{Redis: opt, Pool: pool, Queues: map[string]int{"crossslot-idle": 1},
			DisableReconciler: true}, tasks.NewMux())
		testenv.Eventually(t, 10*time.Second, func() bool {
			s, err := insp.Servers()
			return err == nil && len(s) == 1
		}, "the server never registered")

		// Per queue: a task a dead worker fetched, a scheduled one, an
		// archived one and a missing one, all running in the ledger under an
		// expired lease.
		n := 0
		var ids []string
		type made struct{ active, scheduled, archived, missing string }
		byQueue := map[string]made{}
		for _, kind := range []*tasks.Kind[job]{critical, normal, low} {
			q := map[string]string{critical.Name(): "critical", normal.Name(): "default", low.Name(): "low"}[kind.Name()]
			enqueue := func(opts ...tasks.Option) string {
				res, err := c.Enqueue(ctx, kind.New(job{N: 50_000 + n}, opts...))
				require.NoError(t, err)
				n++
				ids = append(ids, res.Job.ID)
				return res.Job.ID
			}
			var m made
			m.active = enqueue()
			require.NoError(t, testworker.AsynqFetch(ctx, rdb, q, time.Now().Add(-time.Minute)))
			m.scheduled = enqueue(tasks.Delay(time.Hour))
			m.archived = enqueue(tasks.Delay(time.Hour))
			require.NoError(t, insp.ArchiveTask(q, m.archived))
			m.missing = enqueue(tasks.Delay(time.Hour))
			require.NoError(t, insp.DeleteTask(q, m.missing))
			byQueue[q] = m
		}
		_, err = pool.Exec(ctx, `UPDATE keel_jobs SET status = 'running', attempts = 1, lease_holder = 'gone/1',
			lease_until = now() - interval '1 second', run_at = now() - interval '1 second' WHERE id = ANY($1)`, ids)
		require.NoError(t, err)

		r, err := outbox.NewReconciler(outbox.ReconcilerConfig{Pool: pool, Redis: opt})
		require.NoError(t, err)
		defer r.Close()
		rescued, err := r.Rescue(ctx)
		require.NoError(t, err)
		require.Equal(t, len(ids), rescued)
		for q, m := range byQueue {
			for _, id := range []string{m.active, m.scheduled, m.archived, m.missing} {
				info, err := insp.GetTaskInfo(q, id)
				require.NoError(t, err)
				require.Equal(t, asynq.TaskStatePending, info.State, "job %s of queue %s", id, q)
			}
		}

		// The reconciler's pass: open jobs whose tasks are active with a
		// dead worker, archived or missing.
		for q, m := range byQueue {
			require.NoError(t, insp.ArchiveTask(q, m.scheduled))
			require.NoError(t, insp.DeleteTask(q, m.missing))
			require.NoError(t, testworker.AsynqFetch(ctx, rdb, q, time.Now().Add(-time.Minute)))
		}
		_, err = pool.Exec(ctx, `UPDATE keel_jobs SET status = 'pending', lease_holder = NULL, lease_until = NULL,
			updated_at = now() - interval '1 hour' WHERE id = ANY($1)`, ids)
		require.NoError(t, err)
		_, err = r.Reconcile(ctx)
		require.NoError(t, err)
		st := r.Stats()
		require.EqualValues(t, 6, st.Republished, "archived and missing tasks published again")
		require.EqualValues(t, 3, st.Rescued-uint64(rescued), "dead workers' active tasks handed back")
		for q, m := range byQueue {
			for _, id := range []string{m.active, m.scheduled, m.archived, m.missing} {
				info, err := insp.GetTaskInfo(q, id)
				require.NoError(t, err)
				require.Equal(t, asynq.TaskStatePending, info.State, "job %s of queue %s", id, q)
			}
		}
	})

	noCrossSlot(t, addrs...)
}
