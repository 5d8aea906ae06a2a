// Package asynqwire is the one place in keel that knows asynq's private
// Redis layout and wire format, as asynq v0.26.0 writes them
// (internal/base/base.go, internal/rdb/rdb.go, internal/proto/asynq.proto):
// the keys of a queue, the task message, and the Lua scripts keel runs on
// them — publishing many tasks per round trip, handing back a dead worker's
// task, moving a due task, removing a finished one. Its conformance test
// runs asynq's own client and server against these and fails on an asynq
// upgrade that changes them.
package asynqwire

import (
	"context"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
	"google.golang.org/protobuf/encoding/protowire"
)

// QueuesKey is the set of queue names (base.AllQueues).
const QueuesKey = "asynq:queues"

// QueuePrefix is the prefix of every key of queue: its hash tag keeps a
// queue's keys in one Redis Cluster slot.
func QueuePrefix(queue string) string { return "asynq:{" + queue + "}:" }

// TaskKey is the hash of one task.
func TaskKey(queue, id string) string { return QueuePrefix(queue) + "t:" + id }

// pausedKey exists while asynq's servers leave queue alone (asynq's
// Inspector.PauseQueue writes it, with the pause's Unix time).
func pausedKey(queue string) string { return QueuePrefix(queue) + "paused" }

// Pause pauses queue as asynq's inspector does, whether or not asynq knows
// the queue yet, and reports whether it was running.
func Pause(ctx context.Context, rdb redis.Cmdable, queue string, now time.Time) (bool, error) {
	return rdb.SetNX(ctx, pausedKey(queue), now.Unix(), 0).Result()
}

// Unpause lets asynq's servers take queue's tasks again, and reports
// whether it was paused.
func Unpause(ctx context.Context, rdb redis.Cmdable, queue string) (bool, error) {
	n, err := rdb.Del(ctx, pausedKey(queue)).Result()
	return n == 1, err
}

// Paused reports whether queue is paused.
func Paused(ctx context.Context, rdb redis.Cmdable, queue string) (bool, error) {
	n, err := rdb.Exists(ctx, pausedKey(queue)).Result()
	return n == 1, err
}

// Task states, the "state" field of a task's hash.
const (
	StateActive      = "active"
	StatePending     = "pending"
	StateScheduled   = "scheduled"
	StateRetry       = "retry"
	StateArchived    = "archived"
	StateCompleted   = "completed"
	StateAggregating = "aggregating"
)

// WakeChannel is where keel announces work to idle workers
// (internal/wake): Publish and HandBack do, from inside their scripts.
const WakeChannel = "keel:wake"

// DefaultTimeout is what asynq's client sets when a task has neither a
// timeout nor a deadline.
const DefaultTimeout = 30 * time.Minute

// Message is what asynq's TaskMessage holds of a task keel publishes.
type Message struct {
	Type, ID, Queue string
	Payload         []byte
	Retry           int
	Timeout         time.Duration // whole seconds; see Seconds
	Deadline        time.Time     // zero: none
	Headers         [][2]string
}

// Seconds is d as asynq keeps a timeout, in whole seconds: rounded up, since
// truncated a timeout under a second would be none at all (asynq's 30
// minutes) and 1.9 s would cut the handler off at 1 s.
func Seconds(d time.Duration) time.Duration {
	if r := d.Truncate(time.Second); r < d {
		return r + time.Second
	}
	return d
}

// Encode writes m as asynq's TaskMessage, with the fields Client.Enqueue
// sets: the same bytes, so asynq's servers, inspector and asynqmon see no
// difference.
func Encode(m Message) []byte {
	size := 96 + len(m.Payload)
	for _, h := range m.Headers {
		size += 8 + len(h[0]) + len(h[1])
	}
	b := make([]byte, 0, size)
	str := func(num protowire.Number, s string) {
		if s != "" {
			b = protowire.AppendTag(b, num, protowire.BytesType)
			b = protowire.AppendString(b, s)
		}
	}
	varint := func(num protowire.Number, v int64) {
		if v != 0 {
			b = protowire.AppendTag(b, num, protowire.VarintType)
			b = protowire.AppendVarint(b, uint64(v))
		}
	}
	str(1, m.Type)
	if len(m.Payload) > 0 {
		b = protowire.AppendTag(b, 2, protowire.BytesType)
		b = protowire.AppendBytes(b, m.Payload)
	}
	str(3, m.ID)
	str(4, m.Queue)
	varint(5, int64(m.Retry))
	timeout := Seconds(m.Timeout)
	if timeout == 0 && m.Deadline.IsZero() {
		timeout = DefaultTimeout
	}
	varint(8, int64(timeout.Seconds()))
	if !m.Deadline.IsZero() {
		varint(9, m.Deadline.Unix())
	}
	for _, h := range m.Headers {
		// A map entry: a message of key (1) and value (2), written in place.
		k, v := h[0], h[1]
		b = protowire.AppendTag(b, 15, protowire.BytesType)
		b = protowire.AppendVarint(b, uint64(protowire.SizeTag(1)+protowire.SizeBytes(len(k))+protowire.SizeTag(2)+protowire.SizeBytes(len(v))))
		b = protowire.AppendTag(b, 1, protowire.BytesType)
		b = protowire.AppendString(b, k)
		b = protowire.AppendTag(b, 2, protowire.BytesType)
		b = protowire.AppendString(b, v)
	}
	return b
}

// publishScript enqueues tasks of one queue as asynq's enqueue and
// schedule scripts do, each only if its id is not taken. A script stops at
// its first failing command but keeps what it wrote before, so each task's
// list entry goes first: a queue Redis refuses gets no half-written task.
// Tasks due now are announced on WakeChannel when they make an empty queue
// non-empty: a queue with tasks waiting has no idle worker to wake, and
// every worker subscribed receives each announcement.
//
// KEYS[1] asynq:{q}:pending  KEYS[2] asynq:{q}:scheduled  KEYS[3…] asynq:{q}:t:<id>
// ARGV[1] now (unix ns), then per task: id, message, process-at (unix s, 0: now)
// Returns per task 1 (enqueued) or 0 (the id was taken).
var publishScript = redis.NewScript(`
local out = {}
local due = false
local was = redis.call("LLEN", KEYS[1])
for i = 3, #KEYS do
	local a = (i - 3) * 3 + 2
	if redis.call("EXISTS", KEYS[i]) == 1 then
		out[#out + 1] = 0
	elseif ARGV[a + 2] == "0" then
		redis.call("LPUSH", KEYS[1], ARGV[a])
		redis.call("HSET", KEYS[i], "msg", ARGV[a + 1], "state", "pending", "pending_since", ARGV[1])
		out[#out + 1] = 1
		due = true
	else
		redis.call("ZADD", KEYS[2], ARGV[a + 2], ARGV[a])
		redis.call("HSET", KEYS[i], "msg", ARGV[a + 1], "state", "scheduled")
		out[#out + 1] = 1
	end
end
if due and was == 0 then
	redis.call("PUBLISH", "` + WakeChannel + `", KEYS[1])
end
return out
`)

// Entry is one task Publish writes: its id, its encoded message and when
// it is due (zero or past: now).
type Entry struct {
	ID  string
	Msg []byte
	At  time.Time
}

// Publish writes tasks of one queue in one script call and reports, per
// task, whether it was new (false: its id was taken).
func Publish(ctx context.Context, rdb redis.Scripter, queue string, tasks []Entry, now time.Time) ([]bool, error) {
	prefix := QueuePrefix(queue)
	keys := make([]string, 2, 2+len(tasks))
	keys[0], keys[1] = prefix+"pending", prefix+"scheduled"
	args := make([]any, 1, 1+3*len(tasks))
	args[0] = now.UnixNano()
	for _, t := range tasks {
		at := "0"
		if t.At.After(now) {
			at = strconv.FormatInt(t.At.Unix(), 10)
		}
		keys = append(keys, TaskKey(queue, t.ID))
		args = append(args, t.ID, t.Msg, at)
	}
	out, err := publishScript.Run(ctx, rdb, keys, args...).Int64Slice()
	if err != nil {
		return nil, err
	}
	added := make([]bool, len(out))
	for i, n := range out {
		added[i] = n == 1
	}
	return added, nil
}

// takeActiveScript takes a task asynq holds as active off its active list
// and lease set, but only if it is still active and its asynq lease does
// not reach ARGV[2]; then, with ARGV[3] (now, unix ns), it hands the task
// back to the head of its queue, as asynq's own requeue at shutdown does
// (requeueCmd), and without it removes the task, as asynq's Done would
// (doneCmd). Returns 1 done, 0 not active any more, -1 fresh lease.
//
// KEYS[1] asynq:{q}:active  KEYS[2] asynq:{q}:lease  KEYS[3] asynq:{q}:t:<id>
// KEYS[4] asynq:{q}:pending  ARGV[1] id  ARGV[2] fresh-lease cutoff (unix s)
// ARGV[3] now (unix ns), or "" to remove
var takeActiveScript = redis.NewScript(`
if redis.call("HGET", KEYS[3], "state") ~= "active" then
	return 0
end
local s = redis.call("ZSCORE", KEYS[2], ARGV[1])
if s and tonumber(s) >= tonumber(ARGV[2]) then
	return -1
end
if redis.call("LREM", KEYS[1], 0, ARGV[1]) == 0 then
	return 0
end
redis.call("ZREM", KEYS[2], ARGV[1])
if ARGV[3] == "" then
	redis.call("DEL", KEYS[3])
	return 1
end
if redis.call("RPUSH", KEYS[4], ARGV[1]) == 1 then
	redis.call("PUBLISH", "` + WakeChannel + `", KEYS[4])
end
redis.call("HSET", KEYS[3], "state", "pending", "pending_since", ARGV[3])
return 1`)

func takeActive(ctx context.Context, rdb redis.Scripter, queue, id string, freshUntil time.Time, now string) (int64, error) {
	p := QueuePrefix(queue)
	return takeActiveScript.Run(ctx, rdb, []string{p + "active", p + "lease", TaskKey(queue, id), p + "pending"},
		id, freshUntil.Unix(), now).Int64()
}

// HandBack moves an active task a dead worker held back to the head of its
// queue, if its asynq lease does not reach freshUntil: 1 moved, 0 not
// active any more, -1 fresh lease.
func HandBack(ctx context.Context, rdb redis.Scripter, queue, id string, freshUntil, now time.Time) (int64, error) {
	return takeActive(ctx, rdb, queue, id, freshUntil, strconv.FormatInt(now.UnixNano(), 10))
}

// forwardNowScript moves one task from the scheduled or retry set to the
// head of its queue, as asynq's forwarder does when its time has come.
// Returns 1 moved, 0 not in that set (moved meanwhile).
//
// KEYS[1] asynq:{q}:scheduled or :retry  KEYS[2] asynq:{q}:pending
// KEYS[3] asynq:{q}:t:<id>  ARGV[1] id  ARGV[2] now (unix ns)
var forwardNowScript = redis.NewScript(`
local group = redis.call("HGET", KEYS[3], "group")
if group and group ~= "" then
	return 0
end
if redis.call("ZREM", KEYS[1], ARGV[1]) == 0 then
	return 0
end
if redis.call("RPUSH", KEYS[2], ARGV[1]) == 1 then
	redis.call("PUBLISH", "` + WakeChannel + `", KEYS[2])
end
redis.call("HSET", KEYS[3], "state", "pending", "pending_since", ARGV[2])
return 1`)

// ForwardNow moves one task in set (StateScheduled or StateRetry) to its
// queue now.
func ForwardNow(ctx context.Context, rdb redis.Scripter, queue, set, id string, now time.Time) (int64, error) {
	p := QueuePrefix(queue)
	return forwardNowScript.Run(ctx, rdb, []string{p + set, p + "pending", TaskKey(queue, id)}, id, now.UnixNano()).Int64()
}

// deleteInSetScript deletes a task asynq keeps in its archived or completed
// set, which reserves the task id. Returns 1 deleted, 0 not in that set.
//
// KEYS[1] asynq:{q}:archived or :completed  KEYS[2] asynq:{q}:t:<id>
// ARGV[1] id
var deleteInSetScript = redis.NewScript(`
if redis.call("ZREM", KEYS[1], ARGV[1]) == 0 then
	return 0
end
redis.call("DEL", KEYS[2])
return 1`)

// DeleteInSet deletes one task in set (StateArchived or StateCompleted).
func DeleteInSet(ctx context.Context, rdb redis.Scripter, queue, set, id string) (int64, error) {
	p := QueuePrefix(queue)
	return deleteInSetScript.Run(ctx, rdb, []string{p + set, TaskKey(queue, id)}, id).Int64()
}

// RemoveActive removes an active task whose job has finished, as asynq's
// Done would, if its asynq lease does not reach freshUntil: 1 removed, 0
// not active any more, -1 fresh lease.
func RemoveActive(ctx context.Context, rdb redis.Scripter, queue, id string, freshUntil time.Time) (int64, error) {
	return takeActive(ctx, rdb, queue, id, freshUntil, "")
}

// ActiveIDs lists up to limit of queue's active tasks.
func ActiveIDs(ctx context.Context, rdb redis.Cmdable, queue string, limit int64) ([]string, error) {
	return rdb.LRange(ctx, QueuePrefix(queue)+"active", 0, limit-1).Result()
}

// dequeueScript is asynq v0.26's dequeueCmd, verbatim: it makes the tail of
// a queue active under a lease that ends at ARGV[1], as a worker's fetch
// does. Tests use it to leave a task as a worker that died holding it would.
var dequeueScript = redis.NewScript(`
if redis.call("EXISTS", KEYS[2]) == 0 then
	local id = redis.call("RPOPLPUSH", KEYS[1], KEYS[3])
	if id then
		local key = ARGV[2] .. id
		redis.call("HSET", key, "state", "active")
		redis.call("HDEL", key, "pending_since")
		redis.call("ZADD", KEYS[4], ARGV[1], id)
		return redis.call("HGET", key, "msg")
	end
end
return nil`)

// Fetch makes the next pending task of queue active under a lease ending at
// leaseEnd, as a worker's fetch does.
func Fetch(ctx context.Context, rdb redis.Scripter, queue string, leaseEnd time.Time) error {
	p := QueuePrefix(queue)
	return dequeueScript.Run(ctx, rdb, []string{p + "pending", p + "paused", p + "active", p + "lease"},
		leaseEnd.Unix(), p+"t:").Err()
}

// scriptKeys returns the keys of an EVAL or EVALSHA with n keys, without
// copying them (the hook that asks sees every command of a worker).
func scriptKeys(cmd redis.Cmder, n int) []any {
	if name := cmd.Name(); name != "evalsha" && name != "eval" {
		return nil
	}
	args := cmd.Args()
	if len(args) < 3+n {
		return nil
	}
	if k, ok := args[2].(int); !ok || k != n {
		return nil
	}
	return args[3 : 3+n]
}

func hasSuffix(k any, suffix string) bool {
	s, ok := k.(string)
	return ok && strings.HasSuffix(s, suffix)
}

// IsDequeue tells asynq's dequeue script (its keys are a queue's pending,
// paused, active and lease) from other commands a server's client sends.
func IsDequeue(cmd redis.Cmder) bool {
	k := scriptKeys(cmd, 4)
	return k != nil && hasSuffix(k[0], ":pending") && hasSuffix(k[1], ":paused") &&
		hasSuffix(k[2], ":active") && hasSuffix(k[3], ":lease")
}

// IsForward tells asynq's forward script (a queue's scheduled or retry set,
// then its pending list), whose answer is how many tasks it moved.
func IsForward(cmd redis.Cmder) bool {
	k := scriptKeys(cmd, 2)
	return k != nil && (hasSuffix(k[0], ":scheduled") || hasSuffix(k[0], ":retry")) && hasSuffix(k[1], ":pending")
}
