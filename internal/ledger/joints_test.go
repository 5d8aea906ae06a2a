package ledger_test

import (
	"context"
	"maps"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/internal/ledger"
	"github.com/keeljobs/keel/internal/testenv"
)

// Where dependencies, concurrency keys, pauses and retention meet.

func plainJob(id string) ledger.JobInsert {
	return ledger.JobInsert{ID: id, Kind: "parentkind", BusinessKey: id, Queue: "default", Payload: []byte(`{}`)}
}

// waitOn writes child waiting for parents, as an enqueue with After does.
func waitOn(t *testing.T, db *pgxpool.Pool, child ledger.JobInsert, parents ...string) {
	t.Helper()
	ctx := context.Background()
	tx, err := db.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck // after Commit, a no-op
	_, err = ledger.LockParents(ctx, tx, parents, []string{}, []string{})
	require.NoError(t, err)
	_, err = ledger.InsertWaiting(ctx, tx, child, ledger.Waiting{Parents: parents, WaitingOn: len(parents)})
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
}

// act does a person's action to ids, as inspect does.
func act(t *testing.T, db *pgxpool.Pool, a ledger.Action, ids ...string) []ledger.Acted {
	t.Helper()
	ctx := context.Background()
	tx, err := db.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck // after Commit, a no-op
	require.NoError(t, ledger.LockJobs(ctx, tx, ids))
	out, err := ledger.Act(ctx, tx, a, ids, "ops", "note", nil)
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	return out
}

// A parent's success counts its waiting child down once, whatever happens
// to the parent after: one that died after its completing InTx (its
// effects in, its children counted down) and is then discarded leaves a
// child waiting for another parent as it is, and the child is not counted
// as waiting for a dead parent.
func TestAParentsSuccessCountsOnce(t *testing.T) {
	ctx := context.Background()
	db, _ := testenv.PrivatePool(t)
	for _, id := range []string{"p1", "p2"} {
		_, err := ledger.InsertJob(ctx, db, plainJob(id), true)
		require.NoError(t, err)
	}
	waitOn(t, db, plainJob("c"), "p1", "p2")
	setStatus(t, db, "succeeded", "p1")
	// Its handler failed after the completing InTx: dead, effects in.
	_, err := db.Exec(ctx, `UPDATE keel_jobs SET status = 'dead', effects_committed_at = now() WHERE id = 'p1'`)
	require.NoError(t, err)
	require.Equal(t, []string{"waiting"}, statusOf(t, db, "c"))
	w, err := ledger.WaitingByKind(ctx, db)
	require.NoError(t, err)
	require.Len(t, w, 1)
	require.Zero(t, w[0].OnDead, "c waits for p2 alone, pending: no person is needed")
	parents, err := ledger.ParentsOf(ctx, db, "c")
	require.NoError(t, err)
	require.Equal(t, []bool{true, false}, []bool{parents[0].Met, parents[1].Met}, "p1 met, p2 not")

	// Replay refuses a job whose effects are in; a move back to succeeded
	// (no statement of keel's makes one) would still count c down once.
	require.Empty(t, act(t, db, ledger.Replay, "p1"))
	setStatus(t, db, "succeeded", "p1")
	j, err := ledger.GetJob(ctx, db, "c")
	require.NoError(t, err)
	require.Equal(t, ledger.StatusWaiting, j.Status, "released by one parent's success counted twice; p2 has not succeeded")
	require.Equal(t, 1, j.WaitingOn)

	_, err = db.Exec(ctx, `UPDATE keel_jobs SET status = 'dead', effects_committed_at = now() WHERE id = 'p1'`)
	require.NoError(t, err)
	act(t, db, ledger.Discard, "p1")
	j, err = ledger.GetJob(ctx, db, "c")
	require.NoError(t, err)
	require.Equal(t, ledger.StatusWaiting, j.Status, "cancelled by a parent whose success it had counted: %s", j.ResolutionNote)

	setStatus(t, db, "succeeded", "p2")
	require.Equal(t, []string{"pending"}, statusOf(t, db, "c"))
	require.True(t, outboxHas(t, db, "c"))
}

// A child released by hand is no longer its parents': their later success
// does not let it past its concurrency key's limit, their end does not
// cancel it.
func TestAChildReleasedByHandIsLeftToItself(t *testing.T) {
	ctx := context.Background()
	for _, end := range []string{"succeeded", "discarded"} {
		t.Run(end, func(t *testing.T) {
			db, _ := testenv.PrivatePool(t)
			_, err := ledger.InsertJob(ctx, db, plainJob("p"), true)
			require.NoError(t, err)
			_, err = ledger.InsertJob(ctx, db, keyed("a", "acme", 1), true)
			require.NoError(t, err)
			waitOn(t, db, keyed("c", "acme", 1), "p")
			act(t, db, ledger.ReleaseWaiting, "c")
			require.Equal(t, []string{"pending", "held"}, statusOf(t, db, "a", "c"), "released, then held by its key")
			if end == "discarded" {
				setStatus(t, db, "dead", "p")
				act(t, db, ledger.Discard, "p")
			} else {
				setStatus(t, db, end, "p")
			}
			require.Equal(t, []string{"pending", "held"}, statusOf(t, db, "a", "c"))
			require.False(t, outboxHas(t, db, "c"), "published past its key's limit")
		})
	}
}

// A key's job held by its kind's pause keeps its slot against a new job
// of the key too, not only against the held ones: the new job is held
// during the pause, and runs after the paused one once the kind resumes.
func TestAKindsPauseKeepsItsKeysSlotsFromNewJobs(t *testing.T) {
	ctx := context.Background()
	db, _ := testenv.PrivatePool(t)
	for _, id := range []string{"a", "b"} {
		_, err := ledger.InsertJob(ctx, db, keyed(id, "acme", 1), true)
		require.NoError(t, err)
	}
	tx, err := db.Begin(ctx)
	require.NoError(t, err)
	_, err = ledger.PauseKind(ctx, tx, "tenantwork", "ops", "")
	require.NoError(t, err)
	_, err = ledger.HoldKind(ctx, tx, "tenantwork")
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	require.Equal(t, []string{"paused", "held"}, statusOf(t, db, "a", "b"))
	_, err = ledger.InsertJob(ctx, db, keyed("c", "acme", 1), true)
	require.NoError(t, err)
	require.Equal(t, []string{"paused", "held", "held"}, statusOf(t, db, "a", "b", "c"), "admitted past the key's limit")

	tx, err = db.Begin(ctx)
	require.NoError(t, err)
	_, err = ledger.ResumeKind(ctx, tx, "tenantwork", "ops", "")
	require.NoError(t, err)
	_, err = ledger.ReleaseKind(ctx, tx, "tenantwork")
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	require.Equal(t, []string{"pending", "held", "held"}, statusOf(t, db, "a", "b", "c"))
}

// A dead letter that a job waits for is not dropped by its kind's bounds:
// the child would wait for ever on a parent no one can replay, and the
// alert on jobs waiting for a dead parent would go quiet.
func TestADeadParentIsNotDroppedUnderItsChild(t *testing.T) {
	ctx := context.Background()
	db, _ := testenv.PrivatePool(t)
	for _, id := range []string{"p", "lone"} {
		_, err := ledger.InsertJob(ctx, db, plainJob(id), true)
		require.NoError(t, err)
	}
	waitOn(t, db, plainJob("c"), "p")
	_, err := db.Exec(ctx, `UPDATE keel_jobs SET status = 'dead', finished_at = now() - interval '3 hours',
		seen_at = now() - interval '2 hours', drop_noticed_at = now() - interval '2 hours' WHERE id IN ('p', 'lone')`)
	require.NoError(t, err)
	b := ledger.DeadBound{Kind: "parentkind", Keep: time.Hour, Since: time.Now().Add(-4 * time.Hour)}
	n, err := ledger.CountDroppable(ctx, db, b, time.Millisecond, nil)
	require.NoError(t, err)
	require.EqualValues(t, 1, n, "the dead letter no job waits for, alone")
	dropped, err := ledger.DropDeadLetters(ctx, db, b, time.Millisecond, 100, nil)
	require.NoError(t, err)
	require.Equal(t, 1, dropped)
	require.Equal(t, []string{"dead", "waiting"}, statusOf(t, db, "p", "c"))
	w, err := ledger.WaitingByKind(ctx, db)
	require.NoError(t, err)
	require.NotEmpty(t, w)
	require.EqualValues(t, 1, w[0].OnDead, "the child's wait on a dead parent still shows")
}

// A finished job whose given-up handler may still run (stray_until ahead)
// is not pruned: a new job of its key would then run beside that handler.
func TestAPruneLeavesAJobWhoseHandlerMayStillRun(t *testing.T) {
	ctx := context.Background()
	db, _ := testenv.PrivatePool(t)
	for _, id := range []string{"stray", "done"} {
		_, err := ledger.InsertJob(ctx, db, plainJob(id), true)
		require.NoError(t, err)
	}
	_, err := db.Exec(ctx, `UPDATE keel_jobs SET status = 'cancelled', finished_at = now() - interval '2 hours',
		stray_until = CASE id WHEN 'stray' THEN now() + interval '1 hour' END WHERE id IN ('stray', 'done')`)
	require.NoError(t, err)
	n, err := ledger.CountPastKeep(ctx, db, "parentkind", "cancelled", time.Hour, nil)
	require.NoError(t, err)
	require.EqualValues(t, 1, n)
	pruned, err := ledger.PruneKind(ctx, db, "parentkind", "cancelled", time.Hour, 100, nil)
	require.NoError(t, err)
	require.Equal(t, 1, pruned)
	_, err = ledger.GetJob(ctx, db, "stray")
	require.NoError(t, err, "pruned while its handler may still run")

	// A dead letter of a handler given up is kept by the bounds likewise.
	_, err = db.Exec(ctx, `UPDATE keel_jobs SET status = 'dead', seen_at = now(), drop_noticed_at = now() - interval '2 hours',
		finished_at = now() - interval '3 hours' WHERE id = 'stray'`)
	require.NoError(t, err)
	dropped, err := ledger.DropDeadLetters(ctx, db, ledger.DeadBound{Kind: "parentkind", Keep: time.Hour,
		Since: time.Now().Add(-4 * time.Hour)}, time.Millisecond, 100, nil)
	require.NoError(t, err)
	require.Zero(t, dropped, "dropped while its handler may still run")
}

// An upgrade to 0032 marks met the dependencies of the children still
// waiting whose parent succeeded, or died with its effects in after
// counting the child down; a dependency on a parent that died with its
// effects in before the child was enqueued (which the child's count
// includes) stays unmet, and the child's count and its unmet dependencies
// agree.
func TestTheUpgradeMarksTheDependenciesMet(t *testing.T) {
	ctx := context.Background()
	db, _ := testenv.PrivatePool(t)
	for _, id := range []string{"ok", "counted", "before", "open"} {
		_, err := ledger.InsertJob(ctx, db, plainJob(id), true)
		require.NoError(t, err)
	}
	// c1 waits for counted (which succeeds, counting it down, then dies
	// with its effects in) and open; c2 for ok (succeeded before it) and
	// open; c3 for before (dead with its effects in before c3 came, as an
	// older binary counted it) and open.
	waitOn(t, db, plainJob("c1"), "counted", "open")
	setStatus(t, db, "succeeded", "counted", "ok")
	_, err := db.Exec(ctx, `UPDATE keel_jobs SET status = 'dead', effects_committed_at = now() WHERE id IN ('counted', 'before')`)
	require.NoError(t, err)
	waitOn(t, db, plainJob("c2"), "ok", "open")
	_, err = db.Exec(ctx, `UPDATE keel_jobs SET waiting_on = 1 WHERE id = 'c2'`) // ok had succeeded
	require.NoError(t, err)
	_, err = db.Exec(ctx, `INSERT INTO keel_jobs (id, kind, business_key, queue, payload, max_retry, status, waiting_on, published_at)
		VALUES ('c3', 'parentkind', 'c3', 'default', '{}', 3, 'waiting', 2, now());
		INSERT INTO keel_job_deps (parent_id, child_id) VALUES ('before', 'c3'), ('open', 'c3');
		UPDATE keel_job_deps SET met_at = NULL`) // as before 0032
	require.NoError(t, err)

	testenv.ReapplyMigration(t, db, "joints")
	rows, err := db.Query(ctx, `SELECT child_id || '<' || parent_id FROM keel_job_deps WHERE met_at IS NOT NULL ORDER BY 1`)
	require.NoError(t, err)
	met, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	require.Equal(t, []string{"c1<counted", "c2<ok"}, met)
	var disagree int
	require.NoError(t, db.QueryRow(ctx, `SELECT count(*) FROM keel_jobs c WHERE c.status = 'waiting'
		AND c.waiting_on <> (SELECT count(*) FROM keel_job_deps d WHERE d.child_id = c.id AND d.met_at IS NULL)`).Scan(&disagree))
	require.Zero(t, disagree, "a waiting child's count and its unmet dependencies disagree")

	// What the upgrade leaves behaves: discarding counted leaves c1, open's
	// success releases c1 and c2, and c3 waits for before, dead.
	act(t, db, ledger.Discard, "counted")
	require.Equal(t, []string{"waiting"}, statusOf(t, db, "c1"))
	setStatus(t, db, "succeeded", "open")
	require.Equal(t, []string{"pending", "pending", "waiting"}, statusOf(t, db, "c1", "c2", "c3"))
}

// A keyed batch member ended by a statement of its own (a completion with
// a result, InTx's mark, a failure to dead) takes its key's lock before its
// batch's row, as a worker's round does: the two, ending members of one
// batch and key at once, wait for each other in turn rather than deadlock.
func TestAKeyedMembersEndAndARoundDoNotDeadlock(t *testing.T) {
	for _, dead := range []bool{false, true} {
		t.Run(map[bool]string{false: "completed", true: "dead"}[dead], func(t *testing.T) {
			ctx := context.Background()
			db, _ := testenv.PrivatePool(t)
			b1 := runningKeyedBatch(t, db, map[string]string{"A": "k", "C": "k"})

			single := make(chan error, 1)
			go func() {
				if dead {
					_, _, err := ledger.Fail(ctx, db, ledger.Failure{ID: "C", Holder: "w", Run: 1, Status: ledger.StatusDead,
						Error: "boom", Class: "permanent", RunInMS: -1})
					single <- err
					return
				}
				single <- ledger.CompleteWithResult(ctx, db, "C", "w", 1, []byte(`{}`))
			}()
			testenv.Eventually(t, 10*time.Second, b1.lockWaiters(1), "the member's end never waited")
			round := make(chan error, 1)
			go func() {
				round <- ledger.Round(ctx, db, ledger.RoundArgs{Holder: "w", LeaseMS: 60000, Claim: []string{},
					Done: []string{"A"}, DoneRuns: []int32{1}, Batch: true}, func(ledger.Claimed) {})
			}()
			testenv.Eventually(t, 10*time.Second, b1.lockWaiters(2), "the round never waited")
			require.NoError(t, b1.producer.Commit(ctx))
			require.NoError(t, <-single, "the member's end")
			require.NoError(t, <-round, "the round")
			b, err := ledger.GetBatch(ctx, db, "b1")
			require.NoError(t, err)
			require.Equal(t, 2, b.Succeeded+b.Dead)
		})
	}
}

// A keyed job enqueued in a REPEATABLE READ transaction is refused: its
// admission would count the key's jobs in flight in a snapshot older than
// the key's lock, and miss one another enqueue committed meanwhile.
func TestAKeyedJobIsRefusedOutsideReadCommitted(t *testing.T) {
	ctx := context.Background()
	db, _ := testenv.PrivatePool(t)
	tx, err := db.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck // refused
	// The transaction's snapshot is taken here.
	_, err = tx.Exec(ctx, `SELECT 1 FROM keel_jobs LIMIT 1`)
	require.NoError(t, err)
	_, err = ledger.InsertJob(ctx, db, keyed("k1", "acme", 1), true) // the key's one slot, meanwhile
	require.NoError(t, err)
	_, err = ledger.InsertJob(ctx, tx, keyed("k2", "acme", 1), true)
	var pgErr *pgconn.PgError
	require.ErrorAs(t, err, &pgErr)
	require.Equal(t, "KC001", pgErr.Code, pgErr.Message)
	require.Contains(t, pgErr.Message, "READ COMMITTED")
	// A job without a key is not concerned.
	rr, err := db.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
	require.NoError(t, err)
	defer rr.Rollback(ctx) //nolint:errcheck // after Commit, a no-op
	_, err = ledger.InsertJob(ctx, rr, plainJob("plain"), true)
	require.NoError(t, err)
	require.NoError(t, rr.Commit(ctx))
}

// A person's cancel of members of one batch with several keys, and a
// worker's failure of another member of one of those keys, at once: the
// cancel takes its keys in key order before any row's trigger, as a round
// does, and the two wait for each other in turn rather than deadlock.
func TestABulkEndOfSeveralKeysAndAMembersEndDoNotDeadlock(t *testing.T) {
	ctx := context.Background()
	db, _ := testenv.PrivatePool(t)
	b1 := runningKeyedBatch(t, db, map[string]string{"A": "k2", "B": "k1", "C": "k1"})

	bulk := make(chan error, 1)
	go func() {
		tx, err := db.Begin(ctx)
		if err == nil {
			defer tx.Rollback(ctx) //nolint:errcheck // after Commit, a no-op
			if err = ledger.LockJobs(ctx, tx, []string{"A", "B"}); err == nil {
				if _, err = ledger.Act(ctx, tx, ledger.Cancel, []string{"A", "B"}, "ops", "tenant left", nil); err == nil {
					err = tx.Commit(ctx)
				}
			}
		}
		bulk <- err
	}()
	testenv.Eventually(t, 10*time.Second, b1.lockWaiters(1), "the cancel never waited")
	single := make(chan error, 1)
	go func() {
		_, _, err := ledger.Fail(ctx, db, ledger.Failure{ID: "C", Holder: "w", Run: 1, Status: ledger.StatusDead,
			Error: "boom", Class: "permanent", RunInMS: -1})
		single <- err
	}()
	testenv.Eventually(t, 10*time.Second, b1.lockWaiters(2), "the failure never waited")
	require.NoError(t, b1.producer.Commit(ctx))
	require.NoError(t, <-bulk, "the cancel")
	require.NoError(t, <-single, "the failure")
	require.Equal(t, []string{"cancelled", "cancelled", "dead"}, statusOf(t, db, "A", "B", "C"))
}

// A parent superseded since (a tasks.Unique window passed and its key was
// enqueued again, which stores the old job's key as key#id) is named by
// the key it was enqueued with to the child that reads its result, and on
// the child's dependencies.
func TestASupersededParentKeepsItsKeyForItsChild(t *testing.T) {
	ctx := context.Background()
	db, _ := testenv.PrivatePool(t)
	_, err := ledger.InsertJob(ctx, db, plainJob("report:2024"), true)
	require.NoError(t, err)
	waitOn(t, db, plainJob("fan-in"), "report:2024")
	setStatus(t, db, "succeeded", "report:2024")
	_, err = db.Exec(ctx, `UPDATE keel_jobs SET business_key = business_key || '#' || id WHERE id = 'report:2024'`)
	require.NoError(t, err)
	rs, err := ledger.ParentResults(ctx, db, "fan-in")
	require.NoError(t, err)
	require.Len(t, rs, 1)
	require.Equal(t, "report:2024", rs[0].BusinessKey)
	ps, err := ledger.ParentsOf(ctx, db, "fan-in")
	require.NoError(t, err)
	require.Equal(t, "report:2024", ps[0].BusinessKey)
	page, _, err := ledger.ParentsPage(ctx, db, "fan-in", 10)
	require.NoError(t, err)
	require.Equal(t, "report:2024", page[0].BusinessKey)
}

// heldBatch is batch b1 of running keyed members, its row held by a
// producer adding members until the test commits producer.
type heldBatch struct {
	t           *testing.T
	db          *pgxpool.Pool
	producer    pgx.Tx
	producerPID int
}

// runningKeyedBatch makes batch b1 with a running member per id of keys
// (its concurrency key), and holds the batch's row.
func runningKeyedBatch(t *testing.T, db *pgxpool.Pool, keys map[string]string) *heldBatch {
	t.Helper()
	ctx := context.Background()
	_, err := ledger.CreateBatch(ctx, db, "b1", "", nil, nil)
	require.NoError(t, err)
	ids := slices.Sorted(maps.Keys(keys))
	for _, id := range ids {
		j := keyed(id, keys[id], 5)
		j.BatchID = "b1"
		_, err := ledger.InsertJob(ctx, db, j, true)
		require.NoError(t, err)
	}
	require.NoError(t, ledger.Round(ctx, db, ledger.RoundArgs{Holder: "w", LeaseMS: 60000, Claim: ids}, func(ledger.Claimed) {}))
	b := &heldBatch{t: t, db: db}
	b.producer, err = db.Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { b.producer.Rollback(ctx) }) //nolint:errcheck // after Commit, a no-op
	_, err = b.producer.Exec(ctx, `SELECT 1 FROM keel_batches WHERE id = 'b1' FOR UPDATE`)
	require.NoError(t, err)
	require.NoError(t, b.producer.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&b.producerPID))
	return b
}

// lockWaiters is a condition: at least n sessions other than the
// producer's wait for a lock.
func (b *heldBatch) lockWaiters(n int) func() bool {
	return func() bool {
		var got int
		require.NoError(b.t, b.db.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock' AND pid <> $1`, b.producerPID).Scan(&got))
		return got >= n
	}
}
