package idempotency

import (
	"context"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"
	"google.golang.org/protobuf/encoding/protowire"

	"github.com/keeljobs/keel/internal/wake"
)

// Publisher puts ledger jobs into asynq's queues, many per round trip:
// asynq's client enqueues one task per script call, which made publishing,
// not the ledger, the slow half of a relay pass. It writes exactly what
// asynq's Client.Enqueue would (the same task message and keys, see
// asynqwire_test.go), so asynq's servers, inspector and asynqmon see no
// difference. It follows asynq v0.26's Redis layout, like the rescuer's
// scripts (outbox/rescue.go); the tests pin both to that version.
type Publisher struct {
	rdb  redis.UniversalClient
	own  bool
	seen sync.Map // queues already added to asynq's set of queues
}

// NewPublisher connects to the Redis opt names. Close it.
func NewPublisher(opt asynq.RedisConnOpt) *Publisher {
	// Every asynq.RedisConnOpt makes a go-redis universal client.
	return &Publisher{rdb: opt.MakeRedisClient().(redis.UniversalClient), own: true}
}

// NewPublisherOn publishes through rdb, which stays the caller's to close.
func NewPublisherOn(rdb redis.UniversalClient) *Publisher { return &Publisher{rdb: rdb} }

// Close releases the publisher's connections.
func (p *Publisher) Close() error {
	if p.own {
		return p.rdb.Close()
	}
	return nil
}

// asynq v0.26's Redis layout (internal/base/base.go), which the publisher
// and the reconciler's scripts write to. Every key of one queue carries its
// hash tag, so a script on one queue touches one cluster slot.
const AsynqQueuesKey = "asynq:queues" // the set of queue names (base.AllQueues)

// AsynqQueuePrefix is the prefix of every key of queue.
func AsynqQueuePrefix(queue string) string { return "asynq:{" + queue + "}:" }

// AsynqTaskKey is the hash of one task.
func AsynqTaskKey(queue, id string) string { return AsynqQueuePrefix(queue) + "t:" + id }

// publishChunk bounds one script call: long scripts block Redis for
// everyone else, and their arguments travel in one write.
const publishChunk = 200

// publishScript enqueues tasks of one queue as asynq's enqueue and
// schedule scripts do, each only if its id is not taken. A script stops at
// its first failing command but keeps what it wrote before, so each task's
// list entry goes first: a queue Redis refuses gets no half-written task.
//
// Tasks due now are announced on wake.Channel when they make an empty
// queue non-empty, so that idle workers look at once (internal/wake); a
// queue with tasks waiting has no idle worker to wake, and every worker
// subscribed would receive each announcement.
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
	redis.call("PUBLISH", "` + wake.Channel + `", KEYS[1])
end
return out
`)

// publish enqueues jobs, all of one queue and at most publishChunk of them,
// into res.
func (p *Publisher) publish(ctx context.Context, queue string, jobs []Job, res []Published) {
	fail := func(err error) {
		for i := range res {
			res[i] = Published{Err: fmt.Errorf("keel: publish job %s: %w", jobs[i].ID, err)}
		}
	}
	if _, ok := p.seen.Load(queue); !ok {
		if err := p.rdb.SAdd(ctx, AsynqQueuesKey, queue).Err(); err != nil {
			fail(err)
			return
		}
		p.seen.Store(queue, true)
	}
	prefix := AsynqQueuePrefix(queue)
	now := time.Now()
	keys := make([]string, 2, 2+len(jobs))
	keys[0], keys[1] = prefix+"pending", prefix+"scheduled"
	args := make([]any, 1, 1+3*len(jobs))
	args[0] = now.UnixNano()
	for _, j := range jobs {
		at := "0"
		if j.RunAt.After(now) {
			at = strconv.FormatInt(j.RunAt.Unix(), 10)
		}
		keys = append(keys, AsynqTaskKey(queue, j.ID))
		args = append(args, j.ID, taskMessage(j), at)
	}
	out, err := publishScript.Run(ctx, p.rdb, keys, args...).Int64Slice()
	if err == nil && len(out) != len(jobs) {
		err = fmt.Errorf("publish script answered %d results for %d jobs", len(out), len(jobs))
	}
	if err != nil {
		fail(err)
		return
	}
	for i, n := range out {
		res[i] = Published{New: n == 1}
	}
}

// asynqTimeout is a job's timeout as asynq keeps it, in whole seconds:
// rounded up, since truncated a timeout under a second would be none at all
// (asynq's 30 minutes) and 1.9 s would cut the handler off at 1 s.
func asynqTimeout(d time.Duration) time.Duration {
	if r := d.Truncate(time.Second); r < d {
		return r + time.Second
	}
	return d
}

// asynqDefaultTimeout is what asynq's client sets when a task has neither a
// timeout nor a deadline.
const asynqDefaultTimeout = 30 * time.Minute

// taskMessage encodes j as asynq's TaskMessage (internal/proto/asynq.proto
// in asynq v0.26), with the fields Client.Enqueue sets for the task and
// options Task and TaskOptions give.
func taskMessage(j Job) []byte {
	b := make([]byte, 0, 96+len(j.Payload)+2*len(j.BusinessKey)+len(j.TraceParent)+len(j.TraceState))
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
	str(1, j.Kind)
	if len(j.Payload) > 0 {
		b = protowire.AppendTag(b, 2, protowire.BytesType)
		b = protowire.AppendBytes(b, j.Payload)
	}
	str(3, j.ID)
	str(4, j.Queue)
	varint(5, int64(j.MaxRetry+AsynqRetryHeadroom))
	timeout := asynqTimeout(j.Timeout)
	if timeout == 0 && j.Deadline == nil {
		timeout = asynqDefaultTimeout
	}
	varint(8, int64(timeout.Seconds()))
	if j.Deadline != nil {
		varint(9, j.Deadline.Unix())
	}
	eachTaskHeader(j, func(k, v string) {
		// A map entry: a message of key (1) and value (2), written in place.
		b = protowire.AppendTag(b, 15, protowire.BytesType)
		b = protowire.AppendVarint(b, uint64(protowire.SizeTag(1)+protowire.SizeBytes(len(k))+protowire.SizeTag(2)+protowire.SizeBytes(len(v))))
		b = protowire.AppendTag(b, 1, protowire.BytesType)
		b = protowire.AppendString(b, k)
		b = protowire.AppendTag(b, 2, protowire.BytesType)
		b = protowire.AppendString(b, v)
	})
	return b
}
