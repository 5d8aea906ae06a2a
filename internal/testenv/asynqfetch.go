package testenv

import (
	"context"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/keeljobs/keel/idempotency"
)

// asynqDequeue is asynq v0.26's dequeueCmd (internal/rdb/rdb.go), verbatim:
// it makes the tail of a queue active under a lease that ends at ARGV[1],
// as a worker's fetch does.
var asynqDequeue = redis.NewScript(`
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

// AsynqFetch makes the next pending task of queue active under an asynq
// lease ending at leaseEnd, as a worker's fetch does: a test can then leave
// it as a worker that died holding it would.
func AsynqFetch(ctx context.Context, rdb redis.Scripter, queue string, leaseEnd time.Time) error {
	p := idempotency.AsynqQueuePrefix(queue)
	return asynqDequeue.Run(ctx, rdb, []string{p + "pending", p + "paused", p + "active", p + "lease"},
		leaseEnd.Unix(), p+"t:").Err()
}
