package jobstore

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/keeljobs/keel/internal/asynqwire"
)

// Publisher puts ledger jobs into asynq's queues, many per round trip:
// asynq's client enqueues one task per script call, which made publishing,
// not the ledger, the slow half of a relay pass. It writes exactly what
// asynq's Client.Enqueue would (the same task message and keys: the
// layout and the script are internal/asynqwire's), so asynq's servers,
// inspector and asynqmon see no difference.
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

// publishChunk bounds one script call: long scripts block Redis for
// everyone else, and their arguments travel in one write.
const publishChunk = 200

// publish enqueues jobs, all of one queue and at most publishChunk of them,
// into res.
func (p *Publisher) publish(ctx context.Context, queue string, jobs []Job, res []Published) {
	fail := func(err error) {
		for i := range res {
			res[i] = Published{Err: fmt.Errorf("keel: publish job %s: %w", jobs[i].ID, err)}
		}
	}
	if _, ok := p.seen.Load(queue); !ok {
		if err := p.rdb.SAdd(ctx, asynqwire.QueuesKey, queue).Err(); err != nil {
			fail(err)
			return
		}
		p.seen.Store(queue, true)
	}
	entries := make([]asynqwire.Entry, len(jobs))
	for i, j := range jobs {
		entries[i] = asynqwire.Entry{ID: j.ID, Msg: taskMessage(j), At: j.RunAt}
	}
	added, err := asynqwire.Publish(ctx, p.rdb, queue, entries, time.Now())
	if err == nil && len(added) != len(jobs) {
		err = fmt.Errorf("publish script answered %d results for %d jobs", len(added), len(jobs))
	}
	if err != nil {
		fail(err)
		return
	}
	for i, n := range added {
		res[i] = Published{New: n}
	}
}

// taskMessage encodes j as asynq's TaskMessage, with the fields
// Client.Enqueue sets for the task and options Task and TaskOptions give.
func taskMessage(j Job) []byte {
	m := asynqwire.Message{Type: j.Kind, ID: j.ID, Queue: j.Queue, Payload: j.Payload,
		Retry: j.MaxRetry + AsynqRetryHeadroom, Timeout: j.Timeout}
	if j.Deadline != nil {
		m.Deadline = *j.Deadline
	}
	eachTaskHeader(j, func(k, v string) { m.Headers = append(m.Headers, [2]string{k, v}) })
	return asynqwire.Encode(m)
}
