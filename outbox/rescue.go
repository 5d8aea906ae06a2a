package outbox

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/asynqwire"
	"github.com/keeljobs/keel/internal/ledger"
)

// DefaultRescueInterval is how often a reconciler looks for jobs whose
// worker died. A dead worker's ledger lease (server.DefaultLease, 10s,
// renewed every 2s) runs out 8–10s after its death; looking every second
// puts the job back in Redis within about a second of that.
const DefaultRescueInterval = time.Second

// asynqWorkersKey is asynq's registry of live servers' worker hashes
// (base.AllWorkers), scored by when each hash expires.
const asynqWorkersKey = "asynq:workers"

// freshAsynqLease is how far ahead an asynq lease that was taken or extended
// in the last few seconds still reaches. asynq leases a task for 30s at
// dequeue and extends it by 30s every 5s from the worker's heartbeat, in
// whole seconds. A task dequeued less than ~6s ago may not be in its
// server's worker list yet; its lease still reaches at least 23s ahead. A
// dead worker's lease stopped moving when it died, and its ledger lease ran
// out 8s or more after that: at most 22s ahead.
const freshAsynqLease = 23 * time.Second

// requeueActive hands a dead worker's task back to the head of its queue
// (asynqwire.HandBack): 1 moved, 0 not active any more, -1 fresh lease.
func requeueActive(ctx context.Context, rdb redis.Scripter, queue, id string, now time.Time) (int64, error) {
	return asynqwire.HandBack(ctx, rdb, queue, id, now.Add(freshAsynqLease), now)
}

// taskStates reads asynq's state of each task in one pipeline (go-redis
// splits it by slot on a cluster). A task Redis does not hold is "".
func taskStates(ctx context.Context, rdb redis.UniversalClient, queues, ids []string) ([]string, error) {
	if len(ids) == 0 {
		return nil, nil
	}
	cmds := make([]*redis.StringCmd, len(ids))
	pipe := rdb.Pipeline()
	for i, id := range ids {
		cmds[i] = pipe.HGet(ctx, asynqwire.TaskKey(queues[i], id), "state")
	}
	if _, err := pipe.Exec(ctx); err != nil && !errors.Is(err, redis.Nil) {
		return nil, err
	}
	states := make([]string, len(ids))
	for i, c := range cmds {
		s, err := c.Result()
		if err != nil && !errors.Is(err, redis.Nil) {
			return nil, err
		}
		states[i] = s
	}
	return states, nil
}

// runningOnLiveServer reports which of ids a live asynq server lists among
// the tasks it is running: its worker hash expires 10s after its last
// heartbeat, so a killed server's list is gone within 10s.
func runningOnLiveServer(ctx context.Context, rdb redis.UniversalClient, ids []string, now time.Time) (map[string]bool, error) {
	live := map[string]bool{}
	if len(ids) == 0 {
		return live, nil
	}
	// Scores are whole seconds, rounded down: a hash expiring within the
	// next second may carry the score of the second just gone.
	keys, err := rdb.ZRangeByScore(ctx, asynqWorkersKey, &redis.ZRangeBy{Min: strconv.FormatInt(now.Unix()-1, 10), Max: "+inf"}).Result()
	if err != nil || len(keys) == 0 {
		return live, err
	}
	type probe struct {
		id  string
		cmd *redis.BoolCmd
	}
	probes := make([]probe, 0, len(keys)*len(ids))
	pipe := rdb.Pipeline()
	for _, k := range keys {
		for _, id := range ids {
			probes = append(probes, probe{id, pipe.HExists(ctx, k, id)})
		}
	}
	if _, err := pipe.Exec(ctx); err != nil {
		return nil, err
	}
	for _, p := range probes {
		if p.cmd.Val() {
			live[p.id] = true
		}
	}
	return live, nil
}

// Rescue hands the jobs of workers that are gone back to Redis so that
// another worker starts them now, instead of after asynq's own recovery
// (a 30s task lease, a recoverer every minute and a retry delay). It finds
// ledger rows still running under an expired lease and looks at asynq's
// copy of each:
//
//   - active, and no live asynq server runs it: moved to the head of its
//     queue (a server that still runs it — alive, only cut off from the
//     ledger — keeps it);
//   - waiting for a later retry or scheduled: moved to its queue now;
//   - archived or completed: deleted, and the job published again;
//   - missing: published again from the ledger;
//   - pending: left alone, a worker takes it next.
//
// It never changes the ledger row: the worker that claims the job next
// counts the crash against the job's budget. Every step is a conditional
// atomic script or a publish under the job's id, so any number of
// reconcilers may rescue at once. It returns how many jobs it handed back.
func (r *Reconciler) Rescue(ctx context.Context) (int, error) {
	rescued := 0
	cursor := ""
	for {
		cands, err := ledger.RescuePage(ctx, r.pool, cursor, r.cfg.BatchSize, nil)
		if err != nil || len(cands) == 0 {
			return rescued, err
		}
		cursor = cands[len(cands)-1].ID
		n, err := r.rescueBatch(ctx, cands)
		rescued += n
		r.rescued.Add(uint64(n))
		if err != nil || len(cands) < r.cfg.BatchSize {
			return rescued, err
		}
	}
}

func (r *Reconciler) rescueBatch(ctx context.Context, jobs []ledger.Orphan) (int, error) {
	ids, queues := make([]string, len(jobs)), make([]string, len(jobs))
	for i, j := range jobs {
		ids[i], queues[i] = j.ID, j.Queue
	}
	states, err := taskStates(ctx, r.rdb, queues, ids)
	if err != nil {
		return 0, fmt.Errorf("keel rescuer: read task states: %w", err)
	}
	var active []string
	for i, st := range states {
		if st == asynqwire.StateActive {
			active = append(active, ids[i])
		}
	}
	now := time.Now()
	live, err := runningOnLiveServer(ctx, r.rdb, active, now)
	if err != nil {
		return 0, fmt.Errorf("keel rescuer: read asynq's worker lists: %w", err)
	}
	rescued := 0
	var republish []string
	for i, j := range jobs {
		var moved int64
		var err error
		switch st := states[i]; st {
		case asynqwire.StateActive:
			if live[j.ID] {
				continue // its server is alive: only the ledger lost touch with it
			}
			moved, err = requeueActive(ctx, r.rdb, j.Queue, j.ID, now)
		case asynqwire.StateRetry, asynqwire.StateScheduled:
			moved, err = asynqwire.ForwardNow(ctx, r.rdb, j.Queue, st, j.ID, now)
		case asynqwire.StateArchived, asynqwire.StateCompleted:
			if moved, err = asynqwire.DeleteInSet(ctx, r.rdb, j.Queue, st, j.ID); err == nil && moved == 1 {
				republish = append(republish, j.ID)
				continue
			}
		case "":
			republish = append(republish, j.ID)
			continue
		default: // pending, aggregating: a worker takes it next
			continue
		}
		if err != nil {
			return rescued, fmt.Errorf("keel rescuer: hand back job %s (%s in asynq): %w", j.ID, states[i], err)
		}
		if moved == 1 {
			rescued++
			r.cfg.Logger.Info("keel rescuer: job of a gone worker handed back to its queue", "job_id", j.ID,
				"queue", j.Queue, "holder", j.Holder, "asynq_state", states[i])
		}
	}
	n, err := r.republish(ctx, republish, func(j idempotency.Job) bool {
		return j.Status == idempotency.StatusRunning && j.LeaseUntil != nil && j.LeaseUntil.Before(time.Now())
	}, "keel rescuer: job of a gone worker missing from Redis, published again")
	return rescued + n, err
}
