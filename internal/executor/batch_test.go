package executor_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"syscall"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/executor"
	"github.com/keeljobs/keel/internal/jobstore"
	"github.com/keeljobs/keel/internal/testenv"
	"github.com/keeljobs/keel/internal/testworker"
	"github.com/keeljobs/keel/retry"
	"github.com/keeljobs/keel/server"
	"github.com/keeljobs/keel/tasks"
)

const batchChildEnv = "KEEL_BATCH_CHILD"

// member is a batch member's payload; Mode says what its handler does.
type member struct {
	Key  string `json:"key"`
	Mode string `json:"mode"`
}

var (
	batchMember = tasks.Define[member]("test:batch_member", tasks.Key(func(m member) string { return m.Key }))
	batchCB     = tasks.DefineBatchDone("test:batch_cb")
)

// batchMux runs members and records each callback run in callback_runs, in
// the callback's completing transaction, so a second run of one callback
// job could not add a row and a second callback job would.
func batchMux(pool *pgxpool.Pool) *tasks.Mux {
	mux := tasks.NewMux()
	effect := func(ctx context.Context, m member) error {
		return idempotency.InTx(ctx, func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `INSERT INTO effects (job_id, name) VALUES ($1, $2)`, mustJobID(ctx), m.Key)
			return err
		})
	}
	tasks.Handle(mux, batchMember, func(ctx context.Context, m member) error {
		switch m.Mode {
		case "noop":
			return nil
		case "result": // completed with its result, in a statement of its own
			return idempotency.SetResult(ctx, m.Key)
		case "plain": // completed by the guard's round, not by InTx
			_, err := pool.Exec(ctx, `INSERT INTO effects (job_id, name) VALUES ($1, $2)`, mustJobID(ctx), m.Key)
			return err
		case "gate", "gate-plain": // wait for the test to let every member go at once
			for {
				var open bool
				if err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM batch_gate)`).Scan(&open); err != nil {
					return err
				}
				if open {
					break
				}
				select {
				case <-ctx.Done():
					return ctx.Err()
				case <-time.After(5 * time.Millisecond):
				}
			}
			if m.Mode == "gate-plain" {
				return nil
			}
		case "fail": // dies until the test fixes it
			var fixed bool
			if err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM batch_fixed WHERE key = $1)`, m.Key).Scan(&fixed); err != nil {
				return err
			}
			if !fixed {
				return retry.Permanent(errors.New("broken until fixed"))
			}
		}
		return effect(ctx, m)
	})
	tasks.Handle(mux, batchCB, func(ctx context.Context, d tasks.BatchDone) error {
		counts, err := json.Marshal(d.Counts)
		if err != nil {
			return err
		}
		return idempotency.InTx(ctx, func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `INSERT INTO callback_runs (batch_id, generation, event, counts, data)
				VALUES ($1, $2, $3, $4, $5)`, d.BatchID, d.Generation, d.Event, counts, string(d.Data))
			return err
		})
	})
	return mux
}

func mustJobID(ctx context.Context) string {
	id, _ := idempotency.JobID(ctx)
	return id
}

// runBatchChild runs a worker of batchMux when the test binary is started
// as a batch test's child process.
func runBatchChild() bool {
	return testworker.RunChildWorker(batchChildEnv, func(pool *pgxpool.Pool) (server.Config, asynq.Handler) {
		cfg := server.Config{Redis: redisOpt(), Concurrency: 10, ShutdownTimeout: 2 * time.Second,
			Guard: executor.GuardConfig{Lease: 2 * time.Second, LedgerRetry: time.Second}}
		cfg.Relay.PollInterval = 200 * time.Millisecond
		return cfg, batchMux(pool)
	})
}

// startBatchChild starts a worker process; its Postgres connections are
// named after the test's schema so the test can find them in
// pg_stat_activity.
func startBatchChild(t *testing.T, b *bundle) *exec.Cmd {
	t.Helper()
	child := exec.Command(os.Args[0], "-test.run=^$")
	child.Env = b.childEnv(batchChildEnv)
	child.Stdout, child.Stderr = os.Stderr, os.Stderr
	require.NoError(t, child.Start())
	t.Cleanup(func() {
		_ = child.Process.Signal(syscall.SIGTERM)
		_ = child.Wait()
	})
	return child
}

func batchTables(t *testing.T, b *bundle) {
	t.Helper()
	_, err := b.pool.Exec(context.Background(), `CREATE TABLE batch_gate (open bool);
		CREATE TABLE batch_fixed (key text);
		CREATE TABLE callback_runs (batch_id text, generation int, event text, counts jsonb, data text)`)
	require.NoError(t, err)
}

type callbackRun struct {
	Generation int
	Event      string
	Counts     tasks.BatchCounts
}

func (b *bundle) callbackRuns(t *testing.T, batchID string) []callbackRun {
	t.Helper()
	rows, err := b.pool.Query(context.Background(), `SELECT generation, event, counts FROM callback_runs
		WHERE batch_id = $1 ORDER BY generation, event`, batchID)
	require.NoError(t, err)
	runs, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (callbackRun, error) {
		var c callbackRun
		var counts []byte
		if err := r.Scan(&c.Generation, &c.Event, &counts); err != nil {
			return c, err
		}
		return c, json.Unmarshal(counts, &c.Counts)
	})
	require.NoError(t, err)
	return runs
}

// waitCallbackRuns waits until the batch's callbacks ran n times in all,
// then checks that the ledger holds exactly one callback job per run.
func (b *bundle) waitCallbackRuns(t *testing.T, batchID string, n int, timeout time.Duration) []callbackRun {
	t.Helper()
	testenv.Eventually(t, timeout, func() bool {
		return b.count(t, `SELECT count(*) FROM callback_runs WHERE batch_id = $1`, batchID) >= n
	}, "the batch's callbacks did not run %d times", n)
	runs := b.callbackRuns(t, batchID)
	require.Len(t, runs, n, "callback runs: %+v", runs)
	require.Equal(t, n, b.count(t, `SELECT count(*) FROM keel_jobs WHERE kind = $1 AND business_key LIKE 'batch:' || $2 || ':%'`,
		batchCB.Name(), batchID), "callback jobs")
	require.Equal(t, 0, b.count(t, `SELECT count(*) FROM keel_jobs WHERE kind = $1 AND status <> 'succeeded'`, batchCB.Name()))
	return runs
}

func (b *bundle) newBatch(t *testing.T, desc string, members ...member) jobstore.Batch {
	t.Helper()
	ctx := context.Background()
	batch, err := b.client.NewBatch(ctx, tasks.BatchSpec{Description: desc,
		OnComplete: tasks.BatchCallback(batchCB, map[string]string{"desc": desc}),
		OnSuccess:  tasks.BatchCallback(batchCB, nil)})
	require.NoError(t, err)
	ts := make([]*tasks.Task, len(members))
	for i, m := range members {
		ts[i] = batchMember.New(m, tasks.InBatch(batch.ID))
	}
	_, err = b.client.EnqueueMany(ctx, ts...)
	require.NoError(t, err)
	batch, err = b.client.SealBatch(ctx, batch.ID)
	require.NoError(t, err)
	return batch
}

// The last members of a batch finish at the same moment on two worker
// processes: the batch row's lock lets only one of their transactions
// complete it, so each callback is enqueued and run once.
func TestBatchLastMembersOnTwoWorkersFireOnce(t *testing.T) {
	b := setup(t)
	batchTables(t, b)
	const n = 20
	members := make([]member, n)
	for i := range members {
		members[i] = member{Key: fmt.Sprintf("two-%02d", i), Mode: []string{"gate", "gate-plain"}[i%2]}
	}
	batch := b.newBatch(t, "two workers", members...)

	startBatchChild(t, b)
	startBatchChild(t, b)
	testenv.Eventually(t, 30*time.Second, func() bool {
		return b.count(t, `SELECT count(*) FROM keel_jobs WHERE batch_id = $1 AND status = 'running'`, batch.ID) == n &&
			b.count(t, `SELECT count(DISTINCT lease_holder) FROM keel_jobs WHERE batch_id = $1 AND status = 'running'`, batch.ID) == 2
	}, "the two workers never held all the members between them")
	_, err := b.pool.Exec(context.Background(), `INSERT INTO batch_gate VALUES (true)`)
	require.NoError(t, err)

	runs := b.waitCallbackRuns(t, batch.ID, 2, 30*time.Second)
	want := tasks.BatchCounts{Total: n, Succeeded: n}
	require.Equal(t, []callbackRun{{1, tasks.BatchComplete, want}, {1, tasks.BatchSuccess, want}}, runs)
	require.Equal(t, 2, b.count(t, `SELECT count(DISTINCT last_holder) FROM keel_jobs WHERE batch_id = $1`, batch.ID),
		"the members finished on two workers")
	got, err := b.store.GetBatch(context.Background(), batch.ID)
	require.NoError(t, err)
	require.Equal(t, "complete", got.State())
	require.Equal(t, 1, got.Generation)
	require.Equal(t, n, got.Succeeded)
}

// A worker is killed with SIGKILL while its transactions that make the last
// members succeeded wait for the batch row: the InTx one holds its job's
// row, so no other worker can run the job meanwhile, and its COMMIT, sent
// with the mark, lands once the batch row is free (or, had it not been
// sent, it rolls back and runs again elsewhere); the guard's own statement
// commits on its own; the counts stay right, the InTx effect lands once
// and each callback runs once.
func TestBatchWorkerKilledDuringCompletion(t *testing.T) {
	if testing.Short() {
		t.Skip("waits for a killed worker's lease to run out")
	}
	b := setup(t)
	batchTables(t, b)
	ctx := context.Background()
	batch := b.newBatch(t, "killed", member{Key: "kill-intx", Mode: "intx"}, member{Key: "kill-plain", Mode: "plain"})

	lock, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	defer lock.Rollback(ctx) //nolint:errcheck
	_, err = lock.Exec(ctx, `SELECT 1 FROM keel_batches WHERE id = $1 FOR UPDATE`, batch.ID)
	require.NoError(t, err)

	child := startBatchChild(t, b)
	waiting := func(like string) int {
		return b.count(t, `SELECT count(*) FROM pg_stat_activity WHERE application_name = $1
			AND wait_event_type = 'Lock' AND query LIKE $2`, b.schema, like)
	}
	testenv.Eventually(t, 30*time.Second, func() bool {
		return waiting("WITH m AS (UPDATE keel_jobs SET status = 'succeeded'%") == 1 && waiting("WITH done AS%") == 1
	}, "the child's two completions never waited for the batch row")
	require.NoError(t, child.Process.Signal(syscall.SIGKILL))
	_ = child.Wait()
	require.NoError(t, lock.Rollback(ctx))

	b.startWorker(t, batchMux(b.pool), func(c *server.Config) { c.Guard.Lease = 2 * time.Second })
	runs := b.waitCallbackRuns(t, batch.ID, 2, 150*time.Second)
	want := tasks.BatchCounts{Total: 2, Succeeded: 2}
	require.Equal(t, []callbackRun{{1, tasks.BatchComplete, want}, {1, tasks.BatchSuccess, want}}, runs)
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM effects WHERE name = 'kill-intx'`), "the InTx effect is not exactly once")
	got, err := b.store.GetBatch(ctx, batch.ID)
	require.NoError(t, err)
	require.Equal(t, 2, got.Succeeded)
	require.Equal(t, 2, got.Ended())
}

// A member dies: on_complete runs, on_success does not. Replaying it
// reopens the batch; its success completes the batch again, generation 2,
// whose callbacks are new jobs (on_success too, now that all succeeded).
func TestBatchReplayOfADeadMemberReopensIt(t *testing.T) {
	b := setup(t)
	batchTables(t, b)
	ctx := context.Background()
	b.startWorker(t, batchMux(b.pool), nil)
	batch := b.newBatch(t, "replay", member{Key: "r-ok1", Mode: "intx"}, member{Key: "r-ok2", Mode: "plain"},
		member{Key: "r-bad", Mode: "fail"})

	runs := b.waitCallbackRuns(t, batch.ID, 1, 30*time.Second)
	require.Equal(t, []callbackRun{{1, tasks.BatchComplete, tasks.BatchCounts{Total: 3, Succeeded: 2, Dead: 1}}}, runs)
	var data string
	require.NoError(t, b.pool.QueryRow(ctx, `SELECT data FROM callback_runs WHERE batch_id = $1`, batch.ID).Scan(&data))
	require.JSONEq(t, `{"desc": "replay"}`, data)
	dead, err := b.store.Lookup(ctx, batchMember.Name(), "r-bad")
	require.NoError(t, err)
	require.Equal(t, idempotency.StatusDead, dead.Status)

	_, err = b.pool.Exec(ctx, `INSERT INTO batch_fixed VALUES ('r-bad')`)
	require.NoError(t, err)
	insp := asynq.NewInspector(b.redis)
	defer insp.Close()
	_, err = testworker.Ops(t, b.store, insp).Replay(ctx, dead.ID, "ops", "fixed")
	require.NoError(t, err)
	reopened, err := b.store.GetBatch(ctx, batch.ID)
	require.NoError(t, err)
	// The worker may run the replayed member and complete the batch again
	// before this read: then it is already the second generation's.
	if reopened.State() != "sealed" {
		require.Equal(t, 2, reopened.Generation, "a replayed member reopens its batch: %s", reopened.State())
	}
	require.Equal(t, 0, reopened.Dead)

	runs = b.waitCallbackRuns(t, batch.ID, 3, 30*time.Second)
	all := tasks.BatchCounts{Total: 3, Succeeded: 3}
	require.Equal(t, []callbackRun{{1, tasks.BatchComplete, tasks.BatchCounts{Total: 3, Succeeded: 2, Dead: 1}},
		{2, tasks.BatchComplete, all}, {2, tasks.BatchSuccess, all}}, runs)
	done, err := b.store.GetBatch(ctx, batch.ID)
	require.NoError(t, err)
	require.Equal(t, 2, done.Generation)
	require.Equal(t, "complete", done.State())
}

// enqueueBatchInOneTx creates a batch of n members, enqueues them and seals
// it, all in one transaction, as a caller of NewBatchTx, EnqueueManyTx and
// SealBatchTx does; it returns the batch as committed.
func (b *bundle) enqueueBatchInOneTx(t *testing.T, desc string, n int) jobstore.Batch {
	t.Helper()
	ctx := context.Background()
	var batch jobstore.Batch
	require.NoError(t, pgx.BeginFunc(ctx, b.pool, func(tx pgx.Tx) error {
		var err error
		batch, err = b.client.NewBatchTx(ctx, tx, tasks.BatchSpec{Description: desc,
			OnComplete: tasks.BatchCallback(batchCB, nil)})
		if err != nil {
			return err
		}
		ts := make([]*tasks.Task, n)
		for i := range ts {
			ts[i] = batchMember.New(member{Key: fmt.Sprintf("big-%05d", i), Mode: "noop"}, tasks.InBatch(batch.ID))
		}
		if _, err := b.client.EnqueueManyTx(ctx, tx, ts...); err != nil {
			return err
		}
		_, err = b.client.SealBatchTx(ctx, tx, batch.ID)
		return err
	}))
	got, err := b.store.GetBatch(ctx, batch.ID)
	require.NoError(t, err)
	require.Equal(t, n, got.Total)
	require.Equal(t, "sealed", got.State())
	return got
}

// A batch of 10,000 members, enqueued with the batch and sealed in one
// transaction: ten statements of members in the caller's transaction, each
// adding to the batch row the ones before it updated, every member counted
// and none lost. How members run to the callback does not depend on their
// number: TestABatchEnqueuedInOneTransactionRunsToItsCallback runs a
// smaller batch.
func TestBatchOfTenThousandInOneTransaction(t *testing.T) {
	if testing.Short() {
		t.Skip("enqueues 10,000 jobs")
	}
	b := setup(t)
	const n = 10_000
	batch := b.enqueueBatchInOneTx(t, "ten thousand", n)
	require.Equal(t, n, b.count(t, `SELECT count(*) FROM keel_jobs WHERE batch_id = $1 AND status = 'pending'`, batch.ID))
	require.Empty(t, batch.CompleteJobID, "a callback before any member ended")
}

// A batch enqueued with its members and sealed in one transaction (more
// than one statement of members) runs to its callback, once, with every
// member counted: the relay publishes the transaction's rows over several
// passes, the worker completes members fifty at a time.
func TestABatchEnqueuedInOneTransactionRunsToItsCallback(t *testing.T) {
	b := setup(t)
	batchTables(t, b)
	n := jobstore.InsertChunkRows + 500
	batch := b.enqueueBatchInOneTx(t, "fifteen hundred", n)
	b.startWorker(t, batchMux(b.pool), func(c *server.Config) { c.Concurrency = 50 })
	runs := b.waitCallbackRuns(t, batch.ID, 1, time.Minute)
	require.Equal(t, []callbackRun{{1, tasks.BatchComplete, tasks.BatchCounts{Total: n, Succeeded: n}}}, runs)
}
