package testworker

import (
	"context"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/keeljobs/keel/internal/asynqwire"
)

// AsynqFetch makes the next pending task of queue active under an asynq
// lease ending at leaseEnd, as a worker's fetch does: a test can then leave
// it as a worker that died holding it would.
func AsynqFetch(ctx context.Context, rdb redis.Scripter, queue string, leaseEnd time.Time) error {
	return asynqwire.Fetch(ctx, rdb, queue, leaseEnd)
}
