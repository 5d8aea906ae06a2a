package asynqwire_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/internal/asynqwire"
	"github.com/keeljobs/keel/internal/testenv"
)

// The layout, the message and the scripts keel writes are asynq's own, as
// the asynq in go.mod writes and reads them: an upgrade that changes any of
// them fails here.
func TestKeelWritesWhatAsynqWritesAndReads(t *testing.T) {
	rs := testenv.StartRedis(t)
	opt := asynq.RedisClientOpt{Addr: rs.Addr()}
	rdb := redis.NewClient(&redis.Options{Addr: rs.Addr()})
	defer rdb.Close()
	ctx := context.Background()
	client := asynq.NewClient(opt)
	defer client.Close()
	insp := asynq.NewInspector(opt)
	defer insp.Close()

	// asynq's client and keel's Encode write the same message, under the
	// keys keel computes.
	deadline := time.Now().Add(time.Hour).Truncate(time.Second)
	task := asynq.NewTaskWithHeaders("wire:kind", []byte(`{"n":1}`), map[string]string{"k": "v"})
	_, err := client.Enqueue(task, asynq.TaskID("theirs"), asynq.Queue("wire"), asynq.MaxRetry(7),
		asynq.Timeout(90*time.Second), asynq.Deadline(deadline))
	require.NoError(t, err)
	require.True(t, rdb.SIsMember(ctx, asynqwire.QueuesKey, "wire").Val())
	require.Equal(t, []string{"theirs"}, rdb.LRange(ctx, asynqwire.QueuePrefix("wire")+"pending", 0, -1).Val())
	require.Equal(t, asynqwire.StatePending, rdb.HGet(ctx, asynqwire.TaskKey("wire", "theirs"), "state").Val())
	theirs := rdb.HGet(ctx, asynqwire.TaskKey("wire", "theirs"), "msg").Val()
	mine := asynqwire.Encode(asynqwire.Message{Type: "wire:kind", ID: "theirs", Queue: "wire", Payload: []byte(`{"n":1}`),
		Retry: 7, Timeout: 90 * time.Second, Deadline: deadline, Headers: [][2]string{{"k", "v"}}})
	require.Equal(t, theirs, string(mine), "the task message differs from asynq's")

	// What keel publishes, asynq's inspector reads as its own.
	added, err := asynqwire.Publish(ctx, rdb, "wire", []asynqwire.Entry{
		{ID: "now", Msg: asynqwire.Encode(asynqwire.Message{Type: "wire:kind", ID: "now", Queue: "wire", Retry: 3})},
		{ID: "later", Msg: asynqwire.Encode(asynqwire.Message{Type: "wire:kind", ID: "later", Queue: "wire", Retry: 3}),
			At: time.Now().Add(time.Hour)},
		{ID: "theirs", Msg: []byte("taken")},
	}, time.Now())
	require.NoError(t, err)
	require.Equal(t, []bool{true, true, false}, added)
	now, err := insp.GetTaskInfo("wire", "now")
	require.NoError(t, err)
	require.Equal(t, asynq.TaskStatePending, now.State)
	require.Equal(t, 3, now.MaxRetry)
	require.Equal(t, 30*time.Minute, now.Timeout, "asynq's default timeout")
	later, err := insp.GetTaskInfo("wire", "later")
	require.NoError(t, err)
	require.Equal(t, asynq.TaskStateScheduled, later.State)

	// Fetch is asynq's dequeue; HandBack and RemoveActive undo it as asynq's
	// requeue and Done would.
	require.NoError(t, asynqwire.Fetch(ctx, rdb, "wire", time.Now().Add(-time.Second)))
	q, err := insp.GetQueueInfo("wire")
	require.NoError(t, err)
	require.Equal(t, 1, q.Active)
	fetched := rdb.LRange(ctx, asynqwire.QueuePrefix("wire")+"active", 0, -1).Val()
	require.Len(t, fetched, 1)
	n, err := asynqwire.HandBack(ctx, rdb, "wire", fetched[0], time.Now(), time.Now())
	require.NoError(t, err)
	require.EqualValues(t, 1, n)
	info, err := insp.GetTaskInfo("wire", fetched[0])
	require.NoError(t, err)
	require.Equal(t, asynq.TaskStatePending, info.State)
	require.NoError(t, asynqwire.Fetch(ctx, rdb, "wire", time.Now().Add(-time.Second)))
	fetched = rdb.LRange(ctx, asynqwire.QueuePrefix("wire")+"active", 0, -1).Val()
	n, err = asynqwire.RemoveActive(ctx, rdb, "wire", fetched[0], time.Now())
	require.NoError(t, err)
	require.EqualValues(t, 1, n)
	_, err = insp.GetTaskInfo("wire", fetched[0])
	require.ErrorIs(t, err, asynq.ErrTaskNotFound)

	// ForwardNow moves a scheduled task as asynq's forwarder does; an
	// archived one DeleteInSet removes.
	n, err = asynqwire.ForwardNow(ctx, rdb, "wire", asynqwire.StateScheduled, "later", time.Now())
	require.NoError(t, err)
	require.EqualValues(t, 1, n)
	info, err = insp.GetTaskInfo("wire", "later")
	require.NoError(t, err)
	require.Equal(t, asynq.TaskStatePending, info.State)
	require.NoError(t, insp.ArchiveTask("wire", "later"))
	n, err = asynqwire.DeleteInSet(ctx, rdb, "wire", asynqwire.StateArchived, "later")
	require.NoError(t, err)
	require.EqualValues(t, 1, n)
	_, err = insp.GetTaskInfo("wire", "later")
	require.ErrorIs(t, err, asynq.ErrTaskNotFound)
}

// recorder keeps what an asynq server's client sends.
type recorder struct {
	mu       sync.Mutex
	dequeues int
	forwards int
}

func (r *recorder) DialHook(next redis.DialHook) redis.DialHook { return next }
func (r *recorder) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
func (r *recorder) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		r.mu.Lock()
		defer r.mu.Unlock()
		if asynqwire.IsDequeue(cmd) {
			r.dequeues++
		}
		if asynqwire.IsForward(cmd) {
			if c, ok := cmd.(*redis.Cmd); ok {
				if n, _ := c.Int64(); n > 0 {
					r.forwards++
				}
			}
		}
		return err
	}
}

// IsDequeue and IsForward recognise what asynq's server sends when it
// fetches a task and when its forwarder moves a due one.
func TestKeelRecognisesAsynqsFetchAndForward(t *testing.T) {
	rs := testenv.StartRedis(t)
	opt := asynq.RedisClientOpt{Addr: rs.Addr()}
	rc := redis.NewClient(&redis.Options{Addr: rs.Addr()})
	rec := &recorder{}
	rc.AddHook(rec)
	var ran atomic.Int32
	srv := asynq.NewServerFromRedisClient(rc, asynq.Config{Queues: map[string]int{"wire": 1}, DelayedTaskCheckInterval: 100 * time.Millisecond,
		LogLevel: asynq.ErrorLevel})
	require.NoError(t, srv.Start(asynq.HandlerFunc(func(context.Context, *asynq.Task) error { ran.Add(1); return nil })))
	defer srv.Shutdown()
	client := asynq.NewClient(opt)
	defer client.Close()
	_, err := client.Enqueue(asynq.NewTask("wire:later", nil), asynq.Queue("wire"), asynq.ProcessIn(time.Second))
	require.NoError(t, err)
	testenv.Eventually(t, 20*time.Second, func() bool { return ran.Load() == 1 }, "asynq never ran the task")
	rec.mu.Lock()
	defer rec.mu.Unlock()
	require.Positive(t, rec.dequeues, "asynq's fetch was not recognised")
	require.Positive(t, rec.forwards, "asynq's forwarder was not recognised")
}

// keel's pause is asynq's: its inspector sees what keel pauses and
// resumes, and keel sees what its inspector pauses.
func TestKeelPausesAsAsynqDoes(t *testing.T) {
	rs := testenv.StartRedis(t)
	opt := asynq.RedisClientOpt{Addr: rs.Addr()}
	rdb := redis.NewClient(&redis.Options{Addr: rs.Addr()})
	defer rdb.Close()
	ctx := context.Background()
	client := asynq.NewClient(opt)
	defer client.Close()
	insp := asynq.NewInspector(opt)
	defer insp.Close()
	_, err := client.Enqueue(asynq.NewTask("wire:kind", nil), asynq.Queue("held"))
	require.NoError(t, err)

	changed, err := asynqwire.Pause(ctx, rdb, "held", time.Now())
	require.NoError(t, err)
	require.True(t, changed)
	info, err := insp.GetQueueInfo("held")
	require.NoError(t, err)
	require.True(t, info.Paused)
	changed, err = asynqwire.Pause(ctx, rdb, "held", time.Now())
	require.NoError(t, err)
	require.False(t, changed, "paused already")
	changed, err = asynqwire.Unpause(ctx, rdb, "held")
	require.NoError(t, err)
	require.True(t, changed)
	info, err = insp.GetQueueInfo("held")
	require.NoError(t, err)
	require.False(t, info.Paused)

	require.NoError(t, insp.PauseQueue("held"))
	paused, err := asynqwire.Paused(ctx, rdb, "held")
	require.NoError(t, err)
	require.True(t, paused)
}
