package executor_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/jobstore"
)

// PublishMany puts every job in Redis once under its ledger id, says which
// were new, marks the unmarked ones in the ledger, and lets a queue Redis
// refuses fail alone.
func TestPublishManyPublishesEachJobOnceAndMarksIt(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	insp := asynq.NewInspector(b.redis)
	defer insp.Close()
	ac := asynq.NewClient(b.redis)
	defer ac.Close()
	pub := jobstore.NewPublisher(b.redis)
	defer pub.Close()
	rdb := b.redis.MakeRedisClient().(redis.UniversalClient)
	defer rdb.Close()
	// A queue whose pending list is a string: Redis refuses every push to it.
	require.NoError(t, rdb.Set(ctx, "asynq:{broken}:pending", "not a list", 0).Err())
	t.Cleanup(func() { rdb.Del(context.Background(), "asynq:{broken}:pending") })

	var jobs []idempotency.Job
	for i := range 450 { // three groups of the default queue, and the broken one
		q := "default"
		if i == 9 {
			q = "broken"
		}
		j, _, err := b.store.Insert(ctx, b.pool, jobstore.NewJob{Kind: "publish:many", BusinessKey: fmt.Sprint("k-", i),
			Queue: q, Payload: []byte("{}"), MaxRetry: 3})
		require.NoError(t, err)
		jobs = append(jobs, j)
	}
	// One job Redis holds already (a repeated publish).
	_, err := ac.EnqueueContext(ctx, jobstore.Task(jobs[5]), jobstore.TaskOptions(jobs[5])...)
	require.NoError(t, err)

	res, markErr := b.store.PublishMany(ctx, pub, jobs)
	require.NoError(t, markErr)
	require.Len(t, res, len(jobs))
	for i, p := range res {
		switch i {
		case 5:
			require.NoError(t, p.Err)
			require.False(t, p.New, "Redis held job 5 already")
		case 9:
			require.Error(t, p.Err)
		default:
			require.NoError(t, p.Err, "job %d", i)
			require.True(t, p.New, "job %d", i)
		}
	}
	for i, j := range jobs {
		info, err := insp.GetTaskInfo(j.Queue, j.ID)
		got, gerr := b.store.Get(ctx, j.ID)
		require.NoError(t, gerr)
		if i == 9 {
			require.Error(t, err)
			require.Nil(t, got.PublishedAt, "a job that was not published stays unmarked")
			continue
		}
		require.NoError(t, err)
		require.Equal(t, "publish:many", info.Type)
		require.Equal(t, j.BusinessKey, info.Headers[jobstore.HeaderBusinessKey])
		require.NotNil(t, got.PublishedAt, "job %d was published but not marked", i)
	}
	qi, err := insp.GetQueueInfo("default")
	require.NoError(t, err)
	require.Equal(t, len(jobs)-1, qi.Pending, "every job once")

	// Again: nothing new, nothing twice.
	res, markErr = b.store.PublishMany(ctx, pub, append(jobs[:9:9], jobs[10:]...))
	require.NoError(t, markErr)
	for _, p := range res {
		require.NoError(t, p.Err)
		require.False(t, p.New)
	}
	qi, err = insp.GetQueueInfo("default")
	require.NoError(t, err)
	require.Equal(t, len(jobs)-1, qi.Pending)
}

// The publisher writes what asynq's own client writes: the same task as
// asynq reads it back, the same fields in its hash, the same lists and sets.
func TestPublisherWritesWhatAsynqsClientWrites(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	insp := asynq.NewInspector(b.redis)
	defer insp.Close()
	ac := asynq.NewClient(b.redis)
	defer ac.Close()
	pub := jobstore.NewPublisher(b.redis)
	defer pub.Close()
	rdb := b.redis.MakeRedisClient().(redis.UniversalClient)
	defer rdb.Close()

	deadline := time.Now().Add(time.Hour).Truncate(time.Second)
	later := time.Now().Add(time.Hour).Truncate(time.Second)
	cases := map[string]jobstore.NewJob{
		"plain":    {Payload: []byte(`{"a":1}`), MaxRetry: 3},
		"empty":    {Payload: []byte{}, MaxRetry: 0},
		"timeout":  {Payload: []byte(`{}`), MaxRetry: 7, Timeout: 90 * time.Second},
		"deadline": {Payload: []byte(`{}`), MaxRetry: 1, Deadline: deadline},
		"both":     {Payload: []byte(`{}`), MaxRetry: 1, Timeout: time.Minute, Deadline: deadline},
		"later":    {Payload: []byte(`"x"`), MaxRetry: 2, RunAt: later},
	}
	for name, nj := range cases {
		t.Run(name, func(t *testing.T) {
			twin := func(suffix string) idempotency.Job {
				nj := nj
				nj.Kind, nj.BusinessKey, nj.Queue = "publish:wire", name+suffix, "default"
				j, _, err := b.store.Insert(ctx, b.pool, nj)
				require.NoError(t, err)
				return j
			}
			mine, theirs := twin("-keel"), twin("-asynq")
			_, err := ac.EnqueueContext(ctx, jobstore.Task(theirs), jobstore.TaskOptions(theirs)...)
			require.NoError(t, err)
			res, _ := b.store.PublishMany(ctx, pub, []idempotency.Job{mine})
			require.NoError(t, res[0].Err)
			require.True(t, res[0].New)

			a, err := insp.GetTaskInfo("default", theirs.ID)
			require.NoError(t, err)
			k, err := insp.GetTaskInfo("default", mine.ID)
			require.NoError(t, err)
			require.Equal(t, a.Type, k.Type)
			require.Equal(t, a.Payload, k.Payload)
			require.Equal(t, theirs.BusinessKey, a.Headers[jobstore.HeaderBusinessKey])
			require.Equal(t, mine.BusinessKey, k.Headers[jobstore.HeaderBusinessKey])
			require.Equal(t, len(a.Headers), len(k.Headers))
			require.Equal(t, a.Queue, k.Queue)
			require.Equal(t, a.MaxRetry, k.MaxRetry)
			require.Equal(t, a.Timeout, k.Timeout)
			require.Equal(t, a.Deadline, k.Deadline)
			require.Equal(t, a.State, k.State)
			if a.State == asynq.TaskStatePending {
				// asynq reports a pending task's NextProcessAt as the time of
				// the call: the two calls may fall in different seconds.
				require.InDelta(t, a.NextProcessAt.Unix(), k.NextProcessAt.Unix(), 1)
			} else {
				require.Equal(t, a.NextProcessAt.Unix(), k.NextProcessAt.Unix())
			}
			require.Equal(t, a.Retention, k.Retention)

			af, err := rdb.HKeys(ctx, "asynq:{default}:t:"+theirs.ID).Result()
			require.NoError(t, err)
			kf, err := rdb.HKeys(ctx, "asynq:{default}:t:"+mine.ID).Result()
			require.NoError(t, err)
			require.ElementsMatch(t, af, kf, "the task hash's fields")
		})
	}
	member, err := rdb.SIsMember(ctx, "asynq:queues", "default").Result()
	require.NoError(t, err)
	require.True(t, member, "the queue is in asynq's set of queues")
}
