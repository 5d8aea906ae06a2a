package outbox

import (
	"context"
	"fmt"
	"time"

	"github.com/keeljobs/keel/internal/asynqwire"
)

// settleScanLimit bounds how many of a queue's active tasks one settle pass
// looks at: a queue holds at most its workers' concurrency active.
const settleScanLimit = 1000

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
	queues, err := r.rdb.SMembers(ctx, asynqwire.QueuesKey).Result()
	if err != nil {
		return 0, fmt.Errorf("keel reconciler: list queues: %w", err)
	}
	var ids, idQueues []string
	for _, q := range queues {
		active, err := asynqwire.ActiveIDs(ctx, r.rdb, q, settleScanLimit)
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
		n, err := asynqwire.RemoveActive(ctx, r.rdb, candQueues[i], id, now.Add(freshAsynqLease))
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
