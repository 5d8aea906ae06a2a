package executor_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/executor"
	"github.com/keeljobs/keel/internal/jobstore"
	"github.com/keeljobs/keel/internal/pgerr"
	"github.com/keeljobs/keel/internal/testenv"
	"github.com/keeljobs/keel/tasks"
)

// racePool is a second pool on the test schema whose connections name
// themselves, so that a test can see when its statements wait for a lock.
func racePool(t *testing.T, b *bundle) (*pgxpool.Pool, string) {
	t.Helper()
	cfg := b.pool.Config()
	name := "keel-race-" + t.Name()
	cfg.ConnConfig.RuntimeParams["application_name"] = name
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool, name
}

// raceOnBatches runs each of fns on its own goroutine (each one statement
// through the pool named app) while two transactions hold the rows of
// batches first and second. It lets first go once every fn waits for a
// lock, and second once every fn waits again and none for first: a fn that
// locks first's row before second's then holds it, so that fns locking the
// rows in opposite orders are sure to deadlock. It returns their errors.
func raceOnBatches(t *testing.T, b *bundle, app, first, second string, fns ...func() error) []error {
	t.Helper()
	return raceOnRows(t, b, app, "keel_batches", first, second, fns...)
}

// raceOnRows is raceOnBatches on the rows first and second of table.
func raceOnRows(t *testing.T, b *bundle, app, table, first, second string, fns ...func() error) []error {
	t.Helper()
	ctx := context.Background()
	hold := func(id string) (pgx.Tx, int) {
		tx, err := b.pool.Begin(ctx)
		require.NoError(t, err)
		t.Cleanup(func() { tx.Rollback(ctx) }) //nolint:errcheck
		_, err = tx.Exec(ctx, `SELECT 1 FROM `+table+` WHERE id = $1 FOR UPDATE`, id)
		require.NoError(t, err)
		return tx, int(tx.Conn().PgConn().PID())
	}
	holdFirst, firstPID := hold(first)
	holdSecond, _ := hold(second)
	// Every fn waits for a lock, and none for the backend notPID. The lock
	// manager's own state: a granted wait no longer counts.
	allWaiting := func(notPID int) bool {
		return b.count(t, `SELECT count(*) FROM pg_stat_activity a WHERE a.application_name = $1
			AND EXISTS (SELECT 1 FROM pg_locks l WHERE l.pid = a.pid AND NOT l.granted)
			AND NOT $2 = ANY (pg_blocking_pids(a.pid))`, app, notPID) == len(fns)
	}

	errs := make([]error, len(fns))
	var wg sync.WaitGroup
	for i, fn := range fns {
		wg.Go(func() { errs[i] = fn() })
	}
	testenv.Eventually(t, 30*time.Second, func() bool { return allWaiting(0) }, "the statements never all waited for the rows")
	require.NoError(t, holdFirst.Commit(ctx))
	testenv.Eventually(t, 30*time.Second, func() bool { return allWaiting(firstPID) }, "the statements never waited past the first row")
	require.NoError(t, holdSecond.Commit(ctx))
	wg.Wait()
	return errs
}

// newBareBatch makes an open batch without callbacks.
func newBareBatch(t *testing.T, b *bundle, desc string) jobstore.Batch {
	t.Helper()
	batch, err := b.store.CreateBatch(context.Background(), b.pool, jobstore.NewBatch{Description: desc})
	require.NoError(t, err)
	return batch
}

func memberJob(batchID, key string) jobstore.NewJob {
	return jobstore.NewJob{Kind: "test:lock_member", BusinessKey: key, Queue: "default",
		Payload: []byte(`{}`), MaxRetry: 3, BatchID: batchID}
}

func requireBatchCounts(t *testing.T, b *bundle, id string, total, succeeded int, state string) {
	t.Helper()
	got, err := b.store.GetBatch(context.Background(), id)
	require.NoError(t, err)
	require.Equal(t, [2]int{total, succeeded}, [2]int{got.Total, got.Succeeded}, "batch %s: total, succeeded", id)
	require.Equal(t, state, got.State(), "batch %s", id)
}

// Two workers' completion rounds each make members of batches A and B
// succeeded, one meeting A first, the other B. Each member's trigger locks
// its batch row; were the rows locked in the order the members come,
// Postgres would find the rounds deadlocked and abort one, and its marks
// would fail. Both rounds must commit, with the counts right.
func TestBatchCompletionRoundsDoNotDeadlock(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	pool, app := racePool(t, b)
	store := jobstore.NewStore(pool)
	batchA, batchB := newBareBatch(t, b, "A"), newBareBatch(t, b, "B")
	// Written and claimed in this order, so that the members' ids, their
	// places in the table and the rounds' lists agree: round 1 meets A then
	// B, round 2 B then A, whichever plan runs the update.
	var ids []string
	for _, m := range []struct{ batch, key string }{{batchA.ID, "a1"}, {batchB.ID, "b1"}, {batchB.ID, "b2"}, {batchA.ID, "a2"}} {
		j, _, err := b.store.Insert(ctx, b.pool, memberJob(m.batch, m.key))
		require.NoError(t, err)
		ids = append(ids, j.ID)
	}
	for _, id := range []string{batchA.ID, batchB.ID} {
		_, err := b.store.SealBatch(ctx, b.pool, id)
		require.NoError(t, err)
	}
	var log testenv.SyncBuffer
	logger := slog.New(slog.NewTextHandler(&log, nil))
	g1 := executor.NewGuard(store, executor.GuardConfig{Holder: "round-1", Logger: logger})
	defer g1.Close()
	g2 := executor.NewGuard(store, executor.GuardConfig{Holder: "round-2", Logger: logger})
	defer g2.Close()
	var runs []executor.ClaimedRun
	for i, id := range ids {
		g := []*executor.Guard{g1, g1, g2, g2}[i]
		r, err := g.ClaimForTest(ctx, id)
		require.NoError(t, err)
		runs = append(runs, r)
	}

	round := func(g *executor.Guard, runs ...executor.ClaimedRun) func() error {
		return func() error { return errors.Join(g.CompleteRoundForTest(ctx, runs...)...) }
	}
	errs := raceOnBatches(t, b, app, batchA.ID, batchB.ID,
		round(g1, runs[0], runs[1]), round(g2, runs[2], runs[3]))
	require.NoError(t, errs[0], "round 1")
	require.NoError(t, errs[1], "round 2")
	require.NotContains(t, log.String(), "lock conflict", "the rounds must not deadlock at all, not only get over it")
	for _, id := range ids {
		b.waitStatus(t, id, idempotency.StatusSucceeded, time.Second)
	}
	requireBatchCounts(t, b, batchA.ID, 2, 2, "complete")
	requireBatchCounts(t, b, batchB.ID, 2, 2, "complete")
}

// Two InsertMany calls each add members to batches A and B, one meeting A
// first, the other B (rows go in in key order): both must commit. And a
// call of two statements (chunks), the first adding members of B only, the
// second of A, must lock both batches in the first, or it deadlocks with a
// call that locks A then B.
func TestBatchBulkInsertsDoNotDeadlock(t *testing.T) {
	for _, tc := range []struct {
		name         string
		first, other func(lo, hi string) []jobstore.NewJob
	}{{
		name: "one statement each",
		first: func(lo, hi string) []jobstore.NewJob {
			return []jobstore.NewJob{memberJob(lo, "k1"), memberJob(hi, "k2")}
		},
		other: func(lo, hi string) []jobstore.NewJob {
			return []jobstore.NewJob{memberJob(lo, "k4"), memberJob(hi, "k3")}
		},
	}, {
		name: "chunks",
		first: func(lo, hi string) []jobstore.NewJob {
			jobs := []jobstore.NewJob{memberJob(lo, "k2")}
			for i := range jobstore.InsertChunkRows {
				jobs = append(jobs, memberJob(hi, fmt.Sprintf("k1-%04d", i)))
			}
			return jobs
		},
		other: func(lo, hi string) []jobstore.NewJob {
			return []jobstore.NewJob{memberJob(lo, "k3"), memberJob(hi, "k4")}
		},
	}} {
		t.Run(tc.name, func(t *testing.T) {
			b := setup(t)
			ctx := context.Background()
			pool, app := racePool(t, b)
			store := jobstore.NewStore(pool)
			lo, hi := newBareBatch(t, b, "A").ID, newBareBatch(t, b, "B").ID
			if hi < lo {
				lo, hi = hi, lo
			}
			first, other := tc.first(lo, hi), tc.other(lo, hi)
			insert := func(jobs []jobstore.NewJob) func() error {
				return func() error {
					res, err := store.InsertMany(ctx, pool, jobs, jobstore.InsertOptions{})
					for _, r := range res {
						if r.Existed {
							err = fmt.Errorf("job %s existed", r.Job.BusinessKey)
						}
					}
					return err
				}
			}
			// The chunked call waits for hi with its first statement; let
			// the other lock lo first.
			errs := raceOnBatches(t, b, app, lo, hi, insert(first), insert(other))
			require.NoError(t, errs[0], "insert 1")
			require.NoError(t, errs[1], "insert 2")
			members := map[string]int{}
			for _, j := range append(first, other...) {
				members[j.BatchID]++
			}
			requireBatchCounts(t, b, lo, members[lo], 0, "open")
			requireBatchCounts(t, b, hi, members[hi], 0, "open")
		})
	}
}

// A round aborted by a deadlock that lock order cannot prevent (here a
// transaction that holds a batch row and then wants a member's) runs again:
// nothing of it had happened, and its marks succeed.
func TestGuardRoundRetriesADeadlock(t *testing.T) {
	b := setup(t)
	pool, app := racePool(t, b)
	// Postgres aborts whichever backend's check finds the cycle. The test's
	// transaction checks only after a minute, but on a busy host the round
	// may have looked before the transaction waited, and a later wait of
	// the round's may not look again first: then the transaction is the
	// one aborted, and the scenario is tried again on a new batch.
	for try := range 3 {
		if roundMeetsADeadlock(t, b, pool, app, fmt.Sprint("retry-", try)) {
			return
		}
	}
	t.Fatal("Postgres never aborted the round rather than the transaction it deadlocked with")
}

// roundMeetsADeadlock runs the scenario of TestGuardRoundRetriesADeadlock
// on a batch of its own; it returns false when the transaction, not the
// round, was aborted.
func roundMeetsADeadlock(t *testing.T, b *bundle, pool *pgxpool.Pool, app, name string) bool {
	ctx := context.Background()
	batch := newBareBatch(t, b, name)
	j, _, err := b.store.Insert(ctx, b.pool, memberJob(batch.ID, "m"))
	require.NoError(t, err)
	var log testenv.SyncBuffer
	g := executor.NewGuard(jobstore.NewStore(pool), executor.GuardConfig{Holder: name, Logger: slog.New(slog.NewTextHandler(&log, nil))})
	defer g.Close()
	run, err := g.ClaimForTest(ctx, j.ID)
	require.NoError(t, err)

	tx, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck
	// The round, waiting first, is the one that finds the deadlock.
	_, err = tx.Exec(ctx, `SET LOCAL deadlock_timeout = '60s'`)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, `SELECT 1 FROM keel_batches WHERE id = $1 FOR UPDATE`, batch.ID)
	require.NoError(t, err)
	done := make(chan error, 1)
	go func() { done <- errors.Join(g.CompleteRoundForTest(ctx, run)...) }()
	testenv.Eventually(t, 30*time.Second, func() bool {
		return b.count(t, `SELECT count(*) FROM pg_stat_activity a WHERE a.application_name = $1
			AND EXISTS (SELECT 1 FROM pg_locks l WHERE l.pid = a.pid AND NOT l.granted)`, app) == 1
	}, "the round never waited for the batch row")
	// Returns once the round is aborted and has let the member go.
	_, err = tx.Exec(ctx, `SELECT 1 FROM keel_jobs WHERE id = $1 FOR UPDATE`, j.ID)
	if pgerr.Code(err) == "40P01" { // deadlock_detected
		require.NoError(t, tx.Rollback(ctx))
		require.NoError(t, <-done, "the round after the transaction was aborted")
		return false
	}
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	require.NoError(t, <-done)
	require.Contains(t, log.String(), "lock conflict")
	b.waitStatus(t, j.ID, idempotency.StatusSucceeded, time.Second)
	requireBatchCounts(t, b, batch.ID, 1, 1, "open")
	return true
}

// A worker's lease renewal meets a row of its own that is locked (its
// completion round or an InTx is finishing it): it must not wait, or it
// could deadlock with a statement locking the same rows in another order.
// It renews the others, and keeps the locked one as still this run's.
func TestLeaseRenewalDoesNotWaitForLockedRows(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	g := executor.NewGuard(b.store, executor.GuardConfig{Holder: "renewing", Logger: slog.New(slog.DiscardHandler)})
	defer g.Close()
	var runs []executor.ClaimedRun
	for _, key := range []string{"x", "y"} {
		j, _, err := b.store.Insert(ctx, b.pool, jobstore.NewJob{Kind: "test:renew_race", BusinessKey: key, Queue: "default",
			Payload: []byte(`{}`), MaxRetry: 3})
		require.NoError(t, err)
		r, err := g.ClaimForTest(ctx, j.ID)
		require.NoError(t, err)
		runs = append(runs, r)
	}
	leaseOf := func(id string) (until time.Time) {
		require.NoError(t, b.pool.QueryRow(ctx, `SELECT lease_until FROM keel_jobs WHERE id = $1`, id).Scan(&until))
		return until
	}
	before := [2]time.Time{leaseOf(runs[0].ID), leaseOf(runs[1].ID)}
	hold, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	defer hold.Rollback(ctx) //nolint:errcheck
	_, err = hold.Exec(ctx, `SELECT 1 FROM keel_jobs WHERE id = $1 FOR UPDATE`, runs[0].ID)
	require.NoError(t, err)

	// A renewal that waited would hold y's row while it waits for x's.
	rctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	kept, err := g.RenewForTest(rctx, runs[0], runs[1])
	require.NoError(t, err, "the renewal waited for the locked row")
	require.ElementsMatch(t, []string{runs[0].ID, runs[1].ID}, kept, "both runs are still this worker's")
	require.NoError(t, hold.Rollback(ctx))
	require.Equal(t, before[0], leaseOf(runs[0].ID), "the locked row is renewed at the next tick")
	require.True(t, leaseOf(runs[1].ID).After(before[1]), "the free row was not renewed")

	// A row that is no longer this run's is not kept: the loop stops its
	// handler.
	_, err = b.pool.Exec(ctx, `UPDATE keel_jobs SET lease_holder = 'someone-else' WHERE id = $1`, runs[1].ID)
	require.NoError(t, err)
	kept, err = g.RenewForTest(ctx, runs[0], runs[1])
	require.NoError(t, err)
	require.Equal(t, []string{runs[0].ID}, kept)
}

// A transaction that holds a batch's row (a producer adding members, and
// slow to commit) stalls only the completions of that batch's members:
// the worker's other claims and completions go on meanwhile, other
// batches' members' included.
func TestAHeldBatchRowStallsOnlyItsMembersCompletions(t *testing.T) {
	b := setup(t)
	batchTables(t, b)
	ctx := context.Background()
	mux := batchMux(b.pool)
	tasks.Handle(mux, unrelated, func(context.Context, order) error { return nil })
	batch, err := b.client.NewBatch(ctx, tasks.BatchSpec{Description: "held"})
	require.NoError(t, err)

	m, err := b.client.Enqueue(ctx, batchMember.New(member{Key: "held-1", Mode: "gate-plain"}, tasks.InBatch(batch.ID)))
	require.NoError(t, err)
	b.startWorker(t, mux, nil)
	b.waitStatus(t, m.Job.ID, idempotency.StatusRunning, 10*time.Second)
	tx, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck
	_, err = tx.Exec(ctx, `SELECT 1 FROM keel_batches WHERE id = $1 FOR UPDATE`, batch.ID)
	require.NoError(t, err)
	_, err = b.pool.Exec(ctx, `INSERT INTO batch_gate VALUES (true)`)
	require.NoError(t, err)
	// The member ran, and its completion waits for the batch's row.
	testenv.Eventually(t, 20*time.Second, func() bool {
		// The guard's round (its text is cut short here, before the batch lock).
		return b.count(t, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'
			AND query LIKE 'WITH done AS (%' AND datname = current_database()`) > 0
	}, "the member's completion never waited for the batch row")

	other, err := b.client.Enqueue(ctx, unrelated.New(order{OrderID: "unrelated"}))
	require.NoError(t, err)
	b.waitStatus(t, other.Job.ID, idempotency.StatusSucceeded, 10*time.Second)
	// Another batch's members, one completed by the guard's round and one
	// by its InTx (which moves the batch's counters in its own transaction).
	batch2, err := b.client.NewBatch(ctx, tasks.BatchSpec{Description: "free"})
	require.NoError(t, err)
	for _, mode := range []string{"noop", "intx"} {
		m2, err := b.client.Enqueue(ctx, batchMember.New(member{Key: "free-" + mode, Mode: mode}, tasks.InBatch(batch2.ID)))
		require.NoError(t, err)
		b.waitStatus(t, m2.Job.ID, idempotency.StatusSucceeded, 10*time.Second)
	}
	j, err := b.store.Get(ctx, m.Job.ID)
	require.NoError(t, err)
	require.Equal(t, idempotency.StatusRunning, j.Status, "the member's completion cannot land while the row is held")

	require.NoError(t, tx.Rollback(ctx))
	b.waitStatus(t, m.Job.ID, idempotency.StatusSucceeded, 10*time.Second)
}

var unrelated = tasks.Define[order]("test:unrelated", tasks.Key(func(o order) string { return "unrelated:" + o.OrderID }))
