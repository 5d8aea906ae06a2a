package ledger_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/internal/ledger"
	"github.com/keeljobs/keel/internal/testenv"
)

// A key's counts are read by its index, however many of its jobs are held.
func TestConcurrencyPlans(t *testing.T) {
	ctx := context.Background()
	for name, c := range map[string]struct {
		call    func(db ledger.DB)
		indexes []string
	}{
		"keys of a kind": {func(db ledger.DB) { ledger.ConcurrencyKeys(ctx, db, "tenantkind", "", 100) }, []string{"keel_jobs_concurrency_flight", "keel_jobs_concurrency_held"}},        //nolint:errcheck
		"one key":        {func(db ledger.DB) { ledger.ConcurrencyKeys(ctx, db, "tenantkind", "tenant3", 100) }, []string{"keel_jobs_concurrency_flight", "keel_jobs_concurrency_held"}}, //nolint:errcheck
		"held by kind":   {func(db ledger.DB) { ledger.HeldByKind(ctx, db) }, []string{"keel_jobs_waiting"}},                                                                             //nolint:errcheck
	} {
		t.Run(name, func(t *testing.T) {
			usesIndex(t, plan(t, c.call), c.indexes, "keel_jobs")
		})
	}
}

// The admission and release statements the triggers run find a key's jobs
// by its index, on the big ledger, where each of its tenants holds 98.
func TestConcurrencyTriggerPlans(t *testing.T) {
	ctx := context.Background()
	for name, c := range map[string]struct{ sql, index string }{
		"in flight": {`SELECT count(*) FROM keel_jobs WHERE kind = 'tenantkind' AND concurrency_key = 'tenant3'
			AND status IN ('pending', 'running', 'failed') AND id <> 'x'`, "keel_jobs_concurrency_flight"},
		"paused": {`SELECT count(*) FROM (SELECT 1 FROM keel_jobs WHERE kind = 'tenantkind' AND concurrency_key = 'tenant3'
			AND status = 'paused' LIMIT 2) p`, "keel_jobs_concurrency_paused"},
		"oldest held": {`SELECT id FROM keel_jobs WHERE kind = 'tenantkind' AND concurrency_key = 'tenant3'
			AND status = 'waiting' AND key_held_since IS NOT NULL ORDER BY created_at, id LIMIT 1`, "keel_jobs_concurrency_held"},
	} {
		t.Run(name, func(t *testing.T) {
			rows, err := big.Query(ctx, "EXPLAIN "+c.sql)
			require.NoError(t, err)
			var p string
			for rows.Next() {
				var line string
				require.NoError(t, rows.Scan(&line))
				p += line + "\n"
			}
			require.NoError(t, rows.Err())
			usesIndex(t, p, []string{c.index}, "keel_jobs")
			lacks(t, p, "Sort", "Rows Removed")
		})
	}
}

func keyed(id, key string, limit int) ledger.JobInsert {
	return ledger.JobInsert{ID: id, Kind: "tenantwork", BusinessKey: id, Queue: "default", Payload: []byte(`{}`),
		ConcurrencyKey: key, ConcurrencyLimit: limit}
}

func statusOf(t *testing.T, db *pgxpool.Pool, ids ...string) []string {
	t.Helper()
	var out []string
	for _, id := range ids {
		j, err := ledger.GetJob(context.Background(), db, id)
		require.NoError(t, err)
		st := string(j.Status)
		if j.HeldForKey() {
			st = "held"
		}
		out = append(out, st)
	}
	return out
}

func outboxHas(t *testing.T, db *pgxpool.Pool, id string) bool {
	t.Helper()
	var n int
	require.NoError(t, db.QueryRow(context.Background(), `SELECT count(*) FROM keel_outbox WHERE job_id = $1`, id).Scan(&n))
	return n == 1
}

func setStatus(t *testing.T, db *pgxpool.Pool, status string, ids ...string) {
	t.Helper()
	_, err := db.Exec(context.Background(), `UPDATE keel_jobs SET status = $1 WHERE id = ANY($2)`, status, ids)
	require.NoError(t, err)
}

// A key takes jobs up to its limit, whichever statement writes them (one
// row, many rows in one statement); the others are held, out of the
// relay's outbox, and another key is not held back by them.
func TestConcurrencyKeyAdmitsUpToItsLimit(t *testing.T) {
	ctx := context.Background()
	db, _ := testenv.PrivatePool(t)

	row, err := ledger.InsertJob(ctx, db, keyed("a1", "acme", 2), true)
	require.NoError(t, err)
	require.Equal(t, ledger.StatusPending, row.Status)

	var r ledger.JobRows
	for i := 2; i <= 5; i++ {
		id := fmt.Sprintf("a%d", i)
		r.IDs, r.Kinds, r.Keys, r.Queues = append(r.IDs, id), append(r.Kinds, "tenantwork"), append(r.Keys, id), append(r.Queues, "default")
		r.Payloads, r.MaxRetry = append(r.Payloads, []byte(`{}`)), append(r.MaxRetry, 3)
		r.Timeouts, r.MaxWaits = append(r.Timeouts, 0), append(r.MaxWaits, 0)
		r.Deadlines, r.RunAts = append(r.Deadlines, nil), append(r.RunAts, nil)
		r.Summaries, r.Traces, r.Batches = append(r.Summaries, ""), append(r.Traces, ""), append(r.Batches, "")
		r.Expire = append(r.Expire, false)
		r.ConcurrencyKeys, r.ConcurrencyLimits = append(r.ConcurrencyKeys, "acme"), append(r.ConcurrencyLimits, 2)
	}
	held := map[string]ledger.Status{}
	require.NoError(t, ledger.InsertJobs(ctx, db, r, false, true, nil, func(row ledger.NewRow) { held[row.ID] = row.Status }))
	require.Equal(t, map[string]ledger.Status{"a2": "pending", "a3": "waiting", "a4": "waiting", "a5": "waiting"}, held)

	_, err = ledger.InsertJob(ctx, db, keyed("b1", "globex", 2), true)
	require.NoError(t, err)
	require.Equal(t, []string{"pending", "pending", "held", "held", "held", "pending"}, statusOf(t, db, "a1", "a2", "a3", "a4", "a5", "b1"))
	for id, want := range map[string]bool{"a1": true, "a2": true, "a3": false, "a5": false, "b1": true} {
		require.Equal(t, want, outboxHas(t, db, id), id)
	}

	keys, err := ledger.ConcurrencyKeys(ctx, db, "tenantwork", "", 10)
	require.NoError(t, err)
	require.Len(t, keys, 2)
	require.Equal(t, "acme", keys[0].Key)
	require.Equal(t, []int{2, 2, 0, 3}, []int{keys[0].Limit, keys[0].InFlight, keys[0].Running, keys[0].Held})
	require.NotNil(t, keys[0].OldestHeld)
	require.Equal(t, []int{1, 0}, []int{keys[1].InFlight, keys[1].Held})
	byKind, err := ledger.HeldByKind(ctx, db)
	require.NoError(t, err)
	require.Len(t, byKind, 1)
	require.Equal(t, []int64{3, 1}, []int64{byKind[0].Held, byKind[0].Keys})

	// A job that fails keeps its slot; one that ends (succeeded, dead,
	// discarded, cancelled) hands it to the oldest held job, into the
	// outbox in the same transaction.
	setStatus(t, db, "running", "a1")
	setStatus(t, db, "failed", "a1")
	require.Equal(t, []string{"held"}, statusOf(t, db, "a3"))
	setStatus(t, db, "succeeded", "a1")
	require.Equal(t, []string{"pending", "held", "held"}, statusOf(t, db, "a3", "a4", "a5"))
	require.True(t, outboxHas(t, db, "a3"))
	setStatus(t, db, "dead", "a2")
	require.Equal(t, []string{"pending", "held"}, statusOf(t, db, "a4", "a5"))

	// A held job cancelled gives up no slot: a4 and a3 keep theirs.
	setStatus(t, db, "cancelled", "a5")
	require.Equal(t, []string{"pending", "pending", "cancelled"}, statusOf(t, db, "a3", "a4", "a5"))
	_, err = ledger.InsertJob(ctx, db, keyed("a6", "acme", 2), true)
	require.NoError(t, err)
	require.Equal(t, []string{"held"}, statusOf(t, db, "a6"))
	setStatus(t, db, "discarded", "a3")
	require.Equal(t, []string{"pending"}, statusOf(t, db, "a6"))

	// A dead job replayed while its key is full is held, not published.
	setStatus(t, db, "pending", "a2")
	require.Equal(t, []string{"held"}, statusOf(t, db, "a2"))
	setStatus(t, db, "succeeded", "a6")
	require.Equal(t, []string{"pending"}, statusOf(t, db, "a2"))
}

// A job that waits for a parent and has a key is admitted when its parent
// releases it: held if its key is full.
func TestConcurrencyKeyAdmitsAReleasedChild(t *testing.T) {
	ctx := context.Background()
	db, _ := testenv.PrivatePool(t)
	for _, id := range []string{"a1", "p"} {
		_, err := ledger.InsertJob(ctx, db, keyed(id, "acme", 1), true)
		require.NoError(t, err)
	}
	// p has the key too and is held behind a1; make p a parent of c.
	tx, err := db.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck
	par, err := ledger.LockParents(ctx, tx, []string{"a1"}, []string{}, []string{})
	require.NoError(t, err)
	require.Len(t, par, 1)
	_, err = ledger.InsertWaiting(ctx, tx, keyed("c", "acme", 1), ledger.Waiting{Parents: []string{"a1"}, WaitingOn: 1})
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	require.Equal(t, []string{"pending", "held", "waiting"}, statusOf(t, db, "a1", "p", "c"))
	// a1 succeeds: its slot goes to p (held first), and c, released by
	// its parent, finds the key full.
	setStatus(t, db, "succeeded", "a1")
	require.Equal(t, []string{"pending", "held"}, statusOf(t, db, "p", "c"))
	require.False(t, outboxHas(t, db, "c"))
	setStatus(t, db, "succeeded", "p")
	require.Equal(t, []string{"pending"}, statusOf(t, db, "c"))
	require.True(t, outboxHas(t, db, "c"))
}

// Two jobs of a key ending at once, in two transactions, each release one
// held job: the second waits for the first's lock and counts what it
// released, so no slot is lost and none is given twice.
func TestConcurrencyKeyTwoEndsAtOnceReleaseTwo(t *testing.T) {
	ctx := context.Background()
	db, _ := testenv.PrivatePool(t)
	for _, id := range []string{"a1", "a2", "h1", "h2", "h3"} {
		_, err := ledger.InsertJob(ctx, db, keyed(id, "acme", 2), true)
		require.NoError(t, err)
	}
	setStatus(t, db, "running", "a1", "a2")
	tx1, err := db.Begin(ctx)
	require.NoError(t, err)
	defer tx1.Rollback(ctx) //nolint:errcheck
	_, err = tx1.Exec(ctx, `UPDATE keel_jobs SET status = 'succeeded' WHERE id = 'a1'`)
	require.NoError(t, err)
	second := make(chan error, 1)
	go func() {
		_, err := db.Exec(ctx, `UPDATE keel_jobs SET status = 'dead' WHERE id = 'a2'`)
		second <- err
	}()
	require.NoError(t, tx1.Commit(ctx))
	require.NoError(t, <-second)
	require.Equal(t, []string{"pending", "pending", "held"}, statusOf(t, db, "h1", "h2", "h3"))
}

// Two enqueues of a key at once, in two transactions, for its last slot:
// one is admitted, the other held.
func TestConcurrencyKeyTwoInsertsAtOnceAdmitOne(t *testing.T) {
	ctx := context.Background()
	db, _ := testenv.PrivatePool(t)
	tx1, err := db.Begin(ctx)
	require.NoError(t, err)
	defer tx1.Rollback(ctx) //nolint:errcheck
	first, err := ledger.InsertJob(ctx, tx1, keyed("x1", "acme", 1), true)
	require.NoError(t, err)
	require.Equal(t, ledger.StatusPending, first.Status)
	second := make(chan ledger.NewRow, 1)
	go func() {
		row, err := ledger.InsertJob(ctx, db, keyed("x2", "acme", 1), true)
		assert.NoError(t, err)
		second <- row
	}()
	require.NoError(t, tx1.Commit(ctx))
	require.Equal(t, ledger.StatusWaiting, (<-second).Status)
	require.Equal(t, []string{"pending", "held"}, statusOf(t, db, "x1", "x2"))
}

// A bulk insert of one key reads, for each row, only the key's jobs in
// flight (at most its limit), not the rows it held before it: the
// statement stays linear in its rows.
func TestConcurrencyKeyBulkInsertReadsOnlyJobsInFlight(t *testing.T) {
	ctx := context.Background()
	db, _ := testenv.PrivatePool(t)
	const n = 2000
	var r ledger.JobRows
	for i := range n {
		id := fmt.Sprintf("b%04d", i)
		r.IDs, r.Kinds, r.Keys, r.Queues = append(r.IDs, id), append(r.Kinds, "tenantwork"), append(r.Keys, id), append(r.Queues, "default")
		r.Payloads, r.MaxRetry = append(r.Payloads, []byte(`{}`)), append(r.MaxRetry, 3)
		r.Timeouts, r.MaxWaits = append(r.Timeouts, 0), append(r.MaxWaits, 0)
		r.Deadlines, r.RunAts = append(r.Deadlines, nil), append(r.RunAts, nil)
		r.Summaries, r.Traces, r.Batches = append(r.Summaries, ""), append(r.Traces, ""), append(r.Batches, "")
		r.Expire = append(r.Expire, false)
		r.ConcurrencyKeys, r.ConcurrencyLimits = append(r.ConcurrencyKeys, "acme"), append(r.ConcurrencyLimits, 2)
	}
	tx, err := db.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck
	held := 0
	require.NoError(t, ledger.InsertJobs(ctx, tx, r, true, false, nil, func(row ledger.NewRow) {
		if row.Status == ledger.StatusWaiting {
			held++
		}
	}))
	require.Equal(t, n-2, held)
	var read int64
	require.NoError(t, tx.QueryRow(ctx, `SELECT pg_stat_get_xact_tuples_returned('keel_jobs_concurrency_flight'::regclass)
		+ pg_stat_get_xact_tuples_returned('keel_jobs_concurrency_held'::regclass)
		+ pg_stat_get_xact_tuples_returned('keel_jobs'::regclass)`).Scan(&read))
	require.LessOrEqual(t, read, int64(3*n), "index entries and rows read to admit %d rows", n)
}

// Pausing a kind with concurrency keys holds its admitted jobs and leaves
// its key-held ones where they are: nothing of the key is released into
// the outbox (it would only travel through Redis to be held again). The
// resume admits the paused jobs again up to the limit, and the key's ends
// release the rest as before.
func TestAKindPauseDoesNotReleaseItsKeysHeldJobs(t *testing.T) {
	ctx := context.Background()
	db, _ := testenv.PrivatePool(t)
	for i := 1; i <= 4; i++ {
		_, err := ledger.InsertJob(ctx, db, keyed(fmt.Sprint("p", i), "acme", 2), true)
		require.NoError(t, err)
	}
	require.Equal(t, []string{"pending", "pending", "held", "held"}, statusOf(t, db, "p1", "p2", "p3", "p4"))
	_, err := db.Exec(ctx, `DELETE FROM keel_outbox`)
	require.NoError(t, err)

	tx, err := db.Begin(ctx)
	require.NoError(t, err)
	_, err = ledger.PauseKind(ctx, tx, "tenantwork", "ops", "")
	require.NoError(t, err)
	n, err := ledger.HoldKind(ctx, tx, "tenantwork")
	require.NoError(t, err)
	require.EqualValues(t, 2, n)
	require.NoError(t, tx.Commit(ctx))
	require.Equal(t, []string{"paused", "paused", "held", "held"}, statusOf(t, db, "p1", "p2", "p3", "p4"))
	for _, id := range []string{"p3", "p4"} {
		require.False(t, outboxHas(t, db, id), "%s was released by its key while its kind is paused", id)
	}

	tx, err = db.Begin(ctx)
	require.NoError(t, err)
	_, err = ledger.ResumeKind(ctx, tx, "tenantwork", "ops", "")
	require.NoError(t, err)
	_, err = ledger.ReleaseKind(ctx, tx, "tenantwork")
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	require.Equal(t, []string{"pending", "pending", "held", "held"}, statusOf(t, db, "p1", "p2", "p3", "p4"))

	setStatus(t, db, "succeeded", "p1")
	require.Equal(t, []string{"pending", "held"}, statusOf(t, db, "p3", "p4"))
	require.True(t, outboxHas(t, db, "p3"))
}
