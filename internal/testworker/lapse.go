package testworker

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/keeljobs/keel/internal/asynqwire"
)

// LapseKilledWorker moves time on for the killed worker process pid, and
// for it alone, as if the seconds after its death had passed: its leases
// in pool's ledger and its steps' calls in flight ran out, asynq's lease
// on its tasks is no longer fresh, and the list of running tasks its
// heartbeat kept in Redis (at r) expired. Another worker's rescuer then
// hands its jobs back at its next look, instead of 8–10 s after the death.
// How soon that comes after a real death is outbox's
// TestKilledWorkersJobStartsAgainWithinSeconds.
//
// A task the worker took from Redis and died before claiming holds no
// ledger lease: the reconciler hands it back once it was left alone for
// its grace and asynq's lease aged. That lease ages too for the jobs the
// worker claimed last, whatever their state: a worker that died between
// a job's postponement and its next claim leaves such a task.
func LapseKilledWorker(t testing.TB, pool *pgxpool.Pool, r asynq.RedisClientOpt, pid int) {
	t.Helper()
	ctx := context.Background()
	holder := fmt.Sprintf("%%/%d/%%", pid) // host/pid/random
	if _, err := pool.Exec(ctx, `UPDATE keel_jobs SET lease_until = now() - interval '1 millisecond'
		WHERE status = 'running' AND lease_holder LIKE $1`, holder); err != nil {
		t.Fatalf("testworker: lapse leases: %v", err)
	}
	if _, err := pool.Exec(ctx, `UPDATE keel_steps SET call_until = now() - interval '1 millisecond'
		WHERE call_holder LIKE $1 AND call_until IS NOT NULL`, holder); err != nil {
		t.Fatalf("testworker: lapse calls: %v", err)
	}
	// A claim makes its holder the job's last_holder: this holds every job
	// the worker held when it died.
	rows, err := pool.Query(ctx, `SELECT id, queue FROM keel_jobs WHERE last_holder LIKE $1`, holder)
	if err != nil {
		t.Fatalf("testworker: the worker's jobs: %v", err)
	}
	held, err := pgx.CollectRows(rows, pgx.RowToStructByPos[struct{ ID, Queue string }])
	if err != nil {
		t.Fatalf("testworker: the worker's jobs: %v", err)
	}

	rdb := redis.NewClient(&redis.Options{Addr: r.Addr, Username: r.Username, Password: r.Password, DB: r.DB})
	defer rdb.Close()
	for _, j := range held { // XX: only tasks asynq still has active
		if err := rdb.ZAddXX(ctx, asynqwire.QueuePrefix(j.Queue)+"lease",
			redis.Z{Score: float64(time.Now().Unix()), Member: j.ID}).Err(); err != nil {
			t.Fatalf("testworker: age asynq's lease: %v", err)
		}
	}
	// Written at each heartbeat (every 5 s): a worker killed sooner may
	// have none yet.
	keys, err := rdb.Keys(ctx, fmt.Sprintf("asynq:workers:{*:%d:*}", pid)).Result()
	if err != nil {
		t.Fatalf("testworker: asynq's worker lists: %v", err)
	}
	if len(keys) > 0 {
		if err := rdb.Del(ctx, keys...).Err(); err != nil {
			t.Fatalf("testworker: asynq's worker lists: %v", err)
		}
	}
}
