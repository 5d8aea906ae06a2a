package tasks_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/internal/jobstore"
	"github.com/keeljobs/keel/internal/testenv"
	"github.com/keeljobs/keel/internal/testworker"
	"github.com/keeljobs/keel/outbox"
	"github.com/keeljobs/keel/server"
	"github.com/keeljobs/keel/tasks"
)

func keyedTasks(prefix string, n int) []*tasks.Task {
	ts := make([]*tasks.Task, n)
	for i := range ts {
		ts[i] = keyedKind.New(keyed{Key: fmt.Sprintf("%s-%05d", prefix, i)})
	}
	return ts
}

func TestEnqueueManyDeduplicatesAndPublishes(t *testing.T) {
	b := setup(t)
	ctx := context.Background()

	old, err := b.client.Enqueue(ctx, keyedKind.New(keyed{Key: "b"}))
	require.NoError(t, err)

	ts := []*tasks.Task{keyedKind.New(keyed{Key: "c"}), keyedKind.New(keyed{Key: "b"}),
		keyedKind.New(keyed{Key: "a"}), keyedKind.New(keyed{Key: "c", Body: "second"})}
	res, err := b.client.EnqueueMany(ctx, ts...)
	require.NoError(t, err)
	require.Len(t, res, 4)

	require.False(t, res[0].Existed)
	require.True(t, res[0].Published)
	require.True(t, res[1].Existed, "b was enqueued before")
	require.Equal(t, old.Job.ID, res[1].Job.ID)
	require.False(t, res[1].Published, "an existing job is not published again")
	require.False(t, res[2].Existed)
	require.True(t, res[2].Published)
	require.True(t, res[3].Existed, "the second c of the call is the first one's job")
	require.Equal(t, res[0].Job.ID, res[3].Job.ID)
	require.JSONEq(t, `{"key":"c","body":""}`, string(res[3].Job.Payload), "the first payload of a key wins")

	for _, r := range []*tasks.Result{res[0], res[2]} {
		info, err := b.insp.GetTaskInfo("default", r.Job.ID)
		require.NoError(t, err, "Redis holds %s under its ledger id", r.Job.BusinessKey)
		require.Equal(t, r.Job.BusinessKey, info.Headers[tasks.HeaderBusinessKey])
		j, err := b.store.Get(ctx, r.Job.ID)
		require.NoError(t, err)
		require.NotNil(t, j.PublishedAt)
	}
	q, err := b.insp.GetQueueInfo("default")
	require.NoError(t, err)
	require.Equal(t, 3, q.Size, "a, b and c: one task per key")
	require.Equal(t, 3, b.count(t, `SELECT count(*) FROM keel_jobs`))

	res, err = b.client.EnqueueMany(ctx)
	require.NoError(t, err, "an empty call is no error")
	require.Empty(t, res)
}

// One invalid task fails the whole call with an error naming it; nothing of
// the call is written, and the caller's transaction stays usable.
func TestEnqueueManyWithOneBadTaskWritesNothing(t *testing.T) {
	b := setup(t)
	ctx := context.Background()

	for _, tc := range []struct {
		name string
		bad  *tasks.Task
		is   error
		key  string
	}{
		{"payload too large", blob.New(strings.Repeat("a", tasks.MaxPayloadBytes), tasks.BusinessKey("big")), tasks.ErrPayloadTooLarge, "big"},
		{"bad key", keyedKind.New(keyed{Key: "k\x00"}), tasks.ErrInvalidKey, "k\x00"},
		{"unknown queue", keyedKind.New(keyed{Key: "q"}, tasks.Queue("nowhere")), tasks.ErrUnknownQueue, "q"},
		{"kind option on a task", keyedKind.New(keyed{Key: "opt"}, tasks.Key(func(keyed) string { return "x" })), tasks.ErrInvalidTask, "opt"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ts := append(keyedTasks("good", 5), tc.bad, keyedKind.New(keyed{Key: "after"}))
			_, err := b.client.EnqueueMany(ctx, ts...)
			require.ErrorIs(t, err, tc.is)
			var te *tasks.TaskError
			require.True(t, errors.As(err, &te), "got %T %v", err, err)
			require.Equal(t, 5, te.Index)
			require.Equal(t, tc.bad.Kind(), te.Kind)
			require.Equal(t, tc.key, te.BusinessKey)
			require.ErrorContains(t, err, "task 5")
			require.ErrorContains(t, err, tc.bad.Kind())

			tx, err := b.pool.Begin(ctx)
			require.NoError(t, err)
			defer tx.Rollback(ctx)
			_, err = b.client.EnqueueManyTx(ctx, tx, ts...)
			require.ErrorIs(t, err, tc.is)
			_, err = b.client.EnqueueTx(ctx, tx, keyedKind.New(keyed{Key: "tx-still-usable-" + tc.name}))
			require.NoError(t, err)
			require.NoError(t, tx.Commit(ctx))

			require.Equal(t, 0, b.count(t, `SELECT count(*) FROM keel_jobs WHERE business_key NOT LIKE 'tx-still-usable-%'`))
		})
	}
	_, err := b.client.EnqueueMany(ctx, keyedKind.New(keyed{Key: "x"}), nil)
	require.ErrorIs(t, err, tasks.ErrInvalidTask)
	require.ErrorContains(t, err, "task 1")
}

// 10,000 tasks in one transaction: several statements, one commit; a key
// repeated across statements is still one job.
func TestEnqueueManyTxTenThousand(t *testing.T) {
	b := setup(t)
	ctx := context.Background()

	const n = 10_000
	ts := keyedTasks("big", n)
	ts = append(ts, keyedKind.New(keyed{Key: "big-00000", Body: "repeat"}))
	tx, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	res, err := b.client.EnqueueManyTx(ctx, tx, ts...)
	require.NoError(t, err)
	require.Len(t, res, n+1)
	require.True(t, res[n].Existed)
	require.Equal(t, res[0].Job.ID, res[n].Job.ID)
	require.Equal(t, 0, b.count(t, `SELECT count(*) FROM keel_jobs`), "nothing is visible before commit")
	require.NoError(t, tx.Commit(ctx))

	require.Equal(t, n, b.count(t, `SELECT count(*) FROM keel_outbox JOIN keel_jobs ON id = job_id`), "the relay publishes them")
	require.Equal(t, 1, b.count(t, `SELECT count(DISTINCT xmin::text) FROM keel_jobs`))
	for i, r := range res[:n] {
		require.False(t, r.Existed)
		require.Equal(t, fmt.Sprintf("big-%05d", i), r.Job.BusinessKey)
	}

	relay, err := outbox.NewRelay(outbox.RelayConfig{Pool: b.pool, Redis: b.redis, Logger: quietLogger()})
	require.NoError(t, err)
	defer relay.Close()
	for published := 0; published < n; {
		k, err := relay.PublishBatch(ctx)
		require.NoError(t, err)
		require.NotZero(t, k, "%d of %d published", published, n)
		published += k
	}
	q, err := b.insp.GetQueueInfo("default")
	require.NoError(t, err)
	require.Equal(t, n, q.Size)
}

// Invariant 2 for bulk enqueue: Redis stops between the insert and the
// publish; the call still succeeds, the rows are durable, and the relay
// publishes them once Redis is back.
func TestEnqueueManyWithRedisStoppedIsPublishedByRelay(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	srv := testenv.StartRedis(t)
	opt := asynq.RedisClientOpt{Addr: srv.Addr(), DialTimeout: time.Second}
	c, err := tasks.NewClient(tasks.ClientConfig{Redis: opt, Pool: b.pool, Logger: quietLogger()})
	require.NoError(t, err)
	defer c.Close()

	srv.Stop()
	res, err := c.EnqueueMany(ctx, keyedTasks("down", 50)...)
	require.NoError(t, err, "an unreachable Redis must not fail a durable enqueue")
	one, err := c.Enqueue(ctx, keyedKind.New(keyed{Key: "down-single"}))
	require.NoError(t, err)
	require.False(t, one.Published)
	for _, r := range append(res, one) {
		require.False(t, r.Published)
		require.Nil(t, r.Job.PublishedAt)
	}
	require.Equal(t, 51, b.count(t, `SELECT count(*) FROM keel_jobs WHERE published_at IS NULL AND status = 'pending'`),
		"rows Redis did not take are handed back to the relay")

	srv.Start()
	relay, err := outbox.NewRelay(outbox.RelayConfig{Pool: b.pool, Redis: opt, Logger: quietLogger()})
	require.NoError(t, err)
	defer relay.Close()
	n, err := relay.PublishBatch(ctx)
	require.NoError(t, err)
	require.Equal(t, 51, n)
	insp := asynq.NewInspector(opt)
	defer insp.Close()
	for _, r := range append(res, one) {
		_, err := insp.GetTaskInfo("default", r.Job.ID)
		require.NoError(t, err, "job %s", r.Job.BusinessKey)
	}
}

// A process that dies after its group commit wrote the rows (claimed) and
// before it published them loses nothing: the reconciler publishes them.
func TestRowsClaimedButNeverPublishedAreRepublished(t *testing.T) {
	b := setup(t)
	ctx := context.Background()

	// What Enqueue's group commit writes, without the publish that follows.
	got, err := b.store.InsertMany(ctx, b.pool, []jobstore.NewJob{
		{Kind: "test:keyed", BusinessKey: "crashed-1", Queue: "default", Payload: []byte(`{}`), MaxRetry: 3},
		{Kind: "test:keyed", BusinessKey: "crashed-2", Queue: "default", Payload: []byte(`{}`), MaxRetry: 3},
	}, jobstore.InsertOptions{Claim: true})
	require.NoError(t, err)
	relay, err := outbox.NewRelay(outbox.RelayConfig{Pool: b.pool, Redis: b.redis, Logger: quietLogger()})
	require.NoError(t, err)
	defer relay.Close()
	n, err := relay.PublishBatch(ctx)
	require.NoError(t, err)
	require.Zero(t, n, "claimed rows are not the relay's")

	rec, err := outbox.NewReconciler(outbox.ReconcilerConfig{Pool: b.pool, Redis: b.redis, Grace: time.Millisecond, Logger: quietLogger()})
	require.NoError(t, err)
	defer rec.Close()
	testenv.Eventually(t, 10*time.Second, func() bool {
		_, err := rec.Reconcile(ctx)
		require.NoError(t, err)
		for _, g := range got {
			if _, err := b.insp.GetTaskInfo("default", g.Job.ID); err != nil {
				return false
			}
		}
		return true
	}, "the reconciler did not publish the claimed rows")
}

// Group commit: Enqueue calls that wait while a statement runs share the
// next one (one transaction), and a lone call still goes at once.
func TestConcurrentEnqueuesShareOneCommit(t *testing.T) {
	b := setup(t)
	ctx := context.Background()

	// Every insert loop blocks on a key another transaction holds
	// uncommitted.
	gate, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	defer gate.Rollback(ctx)
	var gatePID int
	require.NoError(t, gate.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&gatePID))
	var wg sync.WaitGroup
	for i := range tasks.InsertLoops {
		k := fmt.Sprintf("gate-%d", i)
		_, err := b.client.EnqueueTx(ctx, gate, keyedKind.New(keyed{Key: k}))
		require.NoError(t, err)
		wg.Go(func() {
			_, err := b.client.Enqueue(ctx, keyedKind.New(keyed{Key: k}))
			assert.NoError(t, err)
		})
		testenv.Eventually(t, 10*time.Second, func() bool {
			return b.count(t, `SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))`, gatePID) == i+1
		}, "insert loop %d did not block", i+1)
	}
	const n = 20
	results := make([]*tasks.Result, n)
	for i := range n {
		wg.Go(func() {
			var err error
			results[i], err = b.client.Enqueue(ctx, keyedKind.New(keyed{Key: fmt.Sprintf("shared-%02d", i%10)}))
			assert.NoError(t, err)
		})
	}
	testenv.Eventually(t, 10*time.Second, func() bool { return tasks.QueuedEnqueues(b.client) == n }, "calls did not queue")
	require.NoError(t, gate.Commit(ctx))
	wg.Wait()
	require.False(t, t.Failed())

	require.LessOrEqual(t, b.count(t, `SELECT count(DISTINCT xmin::text) FROM keel_jobs WHERE business_key LIKE 'shared-%'`), tasks.InsertLoops,
		"20 waiting calls took at most one statement per insert loop")
	require.Equal(t, 10, b.count(t, `SELECT count(*) FROM keel_jobs WHERE business_key LIKE 'shared-%'`))
	// Duplicates among the calls of one batch: one job, one creator.
	created := map[string]int{}
	ids := map[string]string{}
	for _, r := range results {
		if !r.Existed {
			created[r.Job.BusinessKey]++
			require.True(t, r.Published)
		}
		if id, ok := ids[r.Job.BusinessKey]; ok {
			require.Equal(t, id, r.Job.ID)
		}
		ids[r.Job.BusinessKey] = r.Job.ID
	}
	require.Len(t, created, 10)
	for k, c := range created {
		require.Equal(t, 1, c, "key %s", k)
	}
}

// Invariant 1 across both paths: Enqueue and EnqueueMany calls racing over
// overlapping keys make one row and one run per key.
func TestConcurrentEnqueueAndEnqueueManyRunEachKeyOnce(t *testing.T) {
	b := setup(t)
	ctx := context.Background()

	const keys = 200
	var mu sync.Mutex
	runs := map[string]int{}
	mux := tasks.NewMux()
	tasks.Handle(mux, keyedKind, func(ctx context.Context, p keyed) error {
		mu.Lock()
		runs[p.Key]++
		mu.Unlock()
		return nil
	})
	testworker.RunServer(t, server.Config{Redis: b.redis, Pool: b.pool, Concurrency: 20, ShutdownTimeout: 2 * time.Second,
		Logger: quietLogger()}, mux)

	var wg sync.WaitGroup
	var creators sync.Map
	note := func(rs ...*tasks.Result) {
		for _, r := range rs {
			if !r.Existed {
				n, _ := creators.LoadOrStore(r.Job.BusinessKey, new(int))
				mu.Lock()
				*n.(*int)++
				mu.Unlock()
			}
		}
	}
	for p := range 8 {
		wg.Go(func() {
			for _, i := range rand.Perm(keys) {
				r, err := b.client.Enqueue(ctx, keyedKind.New(keyed{Key: fmt.Sprintf("race-%03d", i)}))
				if !assert.NoError(t, err, "producer %d", p) {
					return
				}
				note(r)
			}
		})
	}
	for range 4 {
		wg.Go(func() {
			perm := rand.Perm(keys)
			for len(perm) > 0 {
				m := min(len(perm), 37)
				ts := make([]*tasks.Task, m)
				for j, i := range perm[:m] {
					ts[j] = keyedKind.New(keyed{Key: fmt.Sprintf("race-%03d", i)})
				}
				perm = perm[m:]
				rs, err := b.client.EnqueueMany(ctx, ts...)
				if !assert.NoError(t, err) {
					return
				}
				note(rs...)
			}
		})
	}
	wg.Wait()
	require.False(t, t.Failed())
	require.Equal(t, keys, b.count(t, `SELECT count(*) FROM keel_jobs`))
	creators.Range(func(k, v any) bool {
		require.Equal(t, 1, *v.(*int), "key %s created by more than one call", k)
		return true
	})
	testenv.Eventually(t, 30*time.Second, func() bool {
		return b.count(t, `SELECT count(*) FROM keel_jobs WHERE status = 'succeeded'`) == keys
	}, "not every job ran")
	mu.Lock()
	defer mu.Unlock()
	require.Len(t, runs, keys)
	for k, n := range runs {
		require.Equal(t, 1, n, "key %s ran %d times", k, n)
	}
}

func TestEnqueueAfterCloseIsRefused(t *testing.T) {
	b := setup(t)
	c, err := tasks.NewClient(tasks.ClientConfig{Redis: b.redis, Pool: b.pool})
	require.NoError(t, err)
	require.NoError(t, c.Close())
	_, err = c.Enqueue(context.Background(), keyedKind.New(keyed{Key: "closed"}))
	require.ErrorIs(t, err, tasks.ErrClientClosed)
	require.Equal(t, 0, b.count(t, `SELECT count(*) FROM keel_jobs`))
}

// Check and CheckTasks refuse what EnqueueMany would, naming the task, and
// write nothing.
func TestCheckRefusesWhatEnqueueWould(t *testing.T) {
	b := setup(t)
	good := tasks.NewRaw("test:check", []byte(`{}`), "good")
	bad := []*tasks.Task{
		tasks.NewRaw("test:check", []byte(`{}`), "q", tasks.Queue("reports")),
		tasks.NewRaw("test:check", []byte(`{}`), "r", tasks.MaxRetry(-1)),
		tasks.NewRaw("test:check", make([]byte, tasks.MaxPayloadBytes+1), "p"),
		tasks.NewRaw("test:check", []byte(`{}`), ""),
		tasks.NewRaw("test:check", []byte(`{}`), "t", tasks.TraceID("bad \xff utf-8")),
		nil,
	}
	require.NoError(t, b.client.Check(good))
	for i, t1 := range bad {
		err := b.client.Check(good, t1)
		var te *tasks.TaskError
		require.ErrorAs(t, err, &te, "task %d", i)
		require.Equal(t, 1, te.Index)
		_, enqErr := b.client.EnqueueMany(context.Background(), good, t1)
		require.Error(t, enqErr, "Check and EnqueueMany disagree on task %d", i)
	}
	require.NoError(t, tasks.CheckTasks([]string{"reports"}, bad[0]))
	require.ErrorContains(t, tasks.CheckTasks([]string{"bad/queue"}, good), "bad/queue")
	require.ErrorIs(t, tasks.CheckTasks(nil, bad[0]), tasks.ErrUnknownQueue)
	require.Equal(t, 0, b.count(t, `SELECT count(*) FROM keel_jobs`))
}
