package outbox

import (
	"context"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/keeljobs/keel/idempotency"
)

// settleScanLimit bounds how many of a queue's active tasks one settle pass
// looks at: a queue holds at most its workers' concurrency active.
const settleScanLimit = 1000

// settleFinishedScript removes a task asynq still holds as active although
// its job finished in the ledger, as asynq's own Done would have (doneCmd),
// but only if no fresh asynq lease holds it (see freshAsynqLease). Returns
// 1 removed, 0 not active any more, -1 fresh lease.
//
// KEYS[1] asynq:{q}:active  KEYS[2] asynq:{q}:lease  KEYS[3] asynq:{q}:t:<id>
// ARGV[1] id  ARGV[2] fresh-lease cutoff (unix s)
var settleFinishedScript = redis.NewScript(`
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
redis.call("DEL", KEYS[3])
return 1`)

// SettleFinished removes asynq's copies of finished jobs that asynq still
// shows as running. After a Redis failover a worker's acknowledgement of a
// task may be lost (asynq v0.26 retries a failed Done with a context it has
// cancelled already), and the task stays active on the new master until
// asynq's lease, its recoverer and a retry have passed (about 150 s),
// though the ledger says the job succeeded: operators would see phantom
// running jobs. A task is settled when the ledger has its job succeeded,
// discarded or cancelled, no live asynq server lists it among its running
// tasks, and its asynq lease is not fresh. It returns how many it settled.
func (r *Reconciler) SettleFinished(ctx context.Context) (int, error) {
	queues, err := r.rdb.SMembers(ctx, idempotency.AsynqQueuesKey).Result()
	if err != nil {
		return 0, fmt.Errorf("keel reconciler: list queues: %w", err)
	}
	var ids, idQueues []string
	for _, q := range queues {
		active, err := r.rdb.LRange(ctx, idempotency.AsynqQueuePrefix(q)+"active", 0, settleScanLimit-1).Result()
		if err != nil {
			return 0, fmt.Errorf("keel reconciler: read queue %s's active tasks: %w", q, err)
		}
		for _, id := range active {
			ids, idQueues = append(ids, id), append(idQueues, q)
		}
	}
	if len(ids) == 0 {
		return 0, nil
	}
	finished, err := r.store.FinishedAmong(ctx, ids)
	if err != nil {
		return 0, fmt.Errorf("keel reconciler: read the ledger: %w", err)
	}
	var cands, candQueues []string
	for i, id := range ids {
		if finished[id] {
			cands, candQueues = append(cands, id), append(candQueues, idQueues[i])
		}
	}
	if len(cands) == 0 {
		return 0, nil
	}
	now := time.Now()
	live, err := runningOnLiveServer(ctx, r.rdb, cands, now)
	if err != nil {
		return 0, fmt.Errorf("keel reconciler: read asynq's worker lists: %w", err)
	}
	settled := 0
	for i, id := range cands {
		if live[id] {
			continue
		}
		p := idempotency.AsynqQueuePrefix(candQueues[i])
		n, err := settleFinishedScript.Run(ctx, r.rdb, []string{p + "active", p + "lease", idempotency.AsynqTaskKey(candQueues[i], id)},
			id, now.Add(freshAsynqLease).Unix()).Int64()
		if err != nil {
			return settled, fmt.Errorf("keel reconciler: settle finished job %s: %w", id, err)
		}
		if n == 1 {
			settled++
			r.cfg.Logger.Info("keel reconciler: finished job asynq still showed as running settled", "job_id", id, "queue", candQueues[i])
		}
	}
	r.settled.Add(uint64(settled))
	return settled, nil
}
