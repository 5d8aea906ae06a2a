package ledger

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
)

// The statements that write jobs (one, or many in one statement) and read
// them back by id, by key, with their steps.

// newRowColumns are what an insert returns of a row it wrote: the values
// Postgres chose (times are the server's, kept to the microsecond). The
// rest of the row is the NewJob as given (newJobRow), so an insert does
// not send back every column of every row. Its status is pending, or
// waiting when its concurrency key was full (held: see ConcurrencyKeys).
const newRowColumns = `id, run_at, published_at, deadline, created_at, status`

// NewRow is what an insert returns of a row it wrote (newRowColumns).
type NewRow struct {
	ID                    string
	RunAt                 time.Time
	PublishedAt, Deadline *time.Time
	CreatedAt             time.Time
	Status                Status
}

func (r *NewRow) scan(row pgx.Row) error {
	return row.Scan(&r.ID, &r.RunAt, &r.PublishedAt, &r.Deadline, &r.CreatedAt, &r.Status)
}

// insertRow writes one job with ON CONFLICT DO NOTHING; insertSQL and
// insertWakeSQL differ only in its published_at.
const (
	insertRowHead = `INSERT INTO keel_jobs
	(id, kind, business_key, queue, payload, max_retry, timeout_ms, deadline, run_at, payload_summary, trace_id, max_wait_ms,
	 traceparent, tracestate, batch_id, expire_stale, concurrency_key, concurrency_limit, published_at)
	VALUES ($1, $2, $3, $4, $5, $6, $7, $8, coalesce($9, now()), nullif($10, ''), nullif($11, ''), $12,
	 nullif($13, ''), nullif($14, ''), nullif($15, ''), $16, nullif($17, ''), nullif($18::int, 0), `
	insertRowTail = `)
	ON CONFLICT (kind, business_key) DO NOTHING
	RETURNING ` + newRowColumns
)

const insertSQL = insertRowHead + `NULL` + insertRowTail

// insertWakeSQL is insertSQL for a row the relay publishes: a due row goes
// in marked published with its place in the relay's work list (keel_outbox),
// and a relay is woken in the same round trip unless one is awake (see
// RelayAwakeLock). A row to run later goes in unpublished, for
// ClaimUnpublished at its run_at.
const insertWakeSQL = `WITH ins AS (` + insertRowHead + `CASE WHEN coalesce($9, now()) <= now() THEN now() END` + insertRowTail + `),
	outbox AS (INSERT INTO keel_outbox (job_id) SELECT id FROM ins WHERE published_at IS NOT NULL AND status = 'pending'),
	wake AS (SELECT pg_notify('` + RelayChannel + `', '') FROM ins WHERE ` + wakeNeeded + `)
	SELECT * FROM ins WHERE (SELECT count(*) FROM wake) >= 0`

// wakeNeeded is true when the writing transaction must notify (see
// RelayAwakeLock for why writers do not always): a relay is
// settling (it holds the settle lock), or none is awake. Otherwise the
// writer keeps the settle lock, shared, until it commits. CASE fixes the
// order in which the locks are tried.
const wakeNeeded = `CASE WHEN NOT pg_try_advisory_xact_lock_shared(` + RelaySettleLock + `) THEN true
		WHEN pg_try_advisory_xact_lock_shared(` + RelayAwakeLock + `) THEN true
		ELSE false END`

// JobInsert is one row InsertJob writes.
type JobInsert struct {
	ID, Kind, BusinessKey, Queue string
	Payload                      []byte
	MaxRetry                     int
	TimeoutMS                    int64
	Deadline, RunAt              *time.Time // nil RunAt: now
	PayloadSummary, TraceID      string
	MaxWaitMS                    int64
	TraceParent, TraceState      string
	BatchID                      string
	ExpireStale                  bool
	// ConcurrencyKey and ConcurrencyLimit: at most that many jobs of the
	// kind and key in flight at once (empty key: no limit).
	ConcurrencyKey   string
	ConcurrencyLimit int
}

// InsertJob writes r unless its (kind, business key) exists
// (pgx.ErrNoRows then). wake: the relay publishes it (insertWakeSQL).
func InsertJob(ctx context.Context, db DB, r JobInsert, wake bool) (NewRow, error) {
	sql := insertSQL
	if wake {
		sql = insertWakeSQL
	}
	var row NewRow
	err := row.scan(db.QueryRow(ctx, sql, r.ID, r.Kind, r.BusinessKey, r.Queue, r.Payload,
		r.MaxRetry, r.TimeoutMS, r.Deadline, r.RunAt, r.PayloadSummary, r.TraceID, r.MaxWaitMS,
		r.TraceParent, r.TraceState, r.BatchID, r.ExpireStale, r.ConcurrencyKey, r.ConcurrencyLimit))
	return row, err
}

// supersedeSQL moves aside the finished jobs of the given keys that are
// older than their key's window, so the insert that follows makes a new
// job. The rows are locked in key order (as InsertMany writes), so calls
// with overlapping keys cannot deadlock; a row another caller moved aside
// meanwhile no longer matches once its lock is granted.
const supersedeSQL = `UPDATE keel_jobs SET business_key = business_key || '#' || id,
		superseded_at = now(), updated_at = now()
	WHERE id IN (SELECT k.id FROM keel_jobs k
		JOIN unnest($1::text[], $2::text[], $3::bigint[]) AS u(kind, key, window_ms)
			ON k.kind = u.kind AND k.business_key = u.key
		WHERE u.window_ms > 0 AND k.status IN ('succeeded', 'discarded', 'dead', 'cancelled')
			AND k.created_at < now() - u.window_ms * interval '1 millisecond'
		ORDER BY k.kind, k.business_key
		FOR UPDATE OF k)`

// Supersede moves aside the finished jobs of the keys (kind, key, window
// in ms) older than their window.
func Supersede(ctx context.Context, db DB, kinds, keys []string, windowsMS []int64) error {
	_, err := db.Exec(ctx, supersedeSQL, kinds, keys, windowsMS)
	return err
}

// bulkInsertSQL writes the rows given as arrays, in order, skipping those
// whose (kind, business key) exists. $13: write them claimed (published);
// $14: make sure a relay publishes them after commit, as insertWakeSQL does
// (due rows go in published, with an outbox row; a relay is notified unless
// one is awake and polling). $15, $16: the rows' trace
// contexts, empty arrays when none is traced (unnest pads them with NULLs);
// $17: the rows' batch ids (empty strings for none); $18: whether each
// expires at its deadline; $19, $20: the rows' concurrency keys and
// limits, empty arrays when none has a key; $21: the batches of the whole
// call, for bulkInsertBatchSQL.
const bulkInsertSQL = bulkInsertCTEs + `
SELECT * FROM ins WHERE (SELECT count(*) FROM wake) >= 0`

// bulkInsertBatchSQL is bulkInsertSQL for a call whose jobs join batches.
// Each new member's trigger updates its batch's row, at the end of the
// statement, in the order the rows went in (key order): two calls meeting
// batches A and B in opposite orders would deadlock. So once every row is
// in (count reads all of ins first), the rows of the call's batches ($21,
// every chunk's: a later chunk then locks no other) are locked in id
// order, before the triggers run. Jobs outside batches do not pay for it.
const bulkInsertBatchSQL = bulkInsertCTEs + `,
locked AS (
	SELECT id FROM keel_batches WHERE id = ANY ($21::text[]) AND (SELECT count(*) FROM ins) >= 0
	ORDER BY id FOR UPDATE)
SELECT * FROM ins WHERE (SELECT count(*) FROM wake) >= 0 AND (SELECT count(*) FROM locked) >= 0`

const bulkInsertCTEs = `WITH ins AS (
	INSERT INTO keel_jobs (id, kind, business_key, queue, payload, max_retry, timeout_ms, deadline,
		run_at, payload_summary, trace_id, max_wait_ms, published_at, traceparent, tracestate, batch_id, expire_stale,
		concurrency_key, concurrency_limit)
	SELECT i.id, i.kind, i.business_key, i.queue, i.payload, i.max_retry, i.timeout_ms, i.deadline,
		coalesce(i.run_at, now()), nullif(i.summary, ''), nullif(i.trace_id, ''), i.max_wait_ms,
		CASE WHEN $13::bool OR ($14::bool AND coalesce(i.run_at, now()) <= now()) THEN now() END, nullif(i.traceparent, ''), nullif(i.tracestate, ''), nullif(i.batch_id, ''),
		i.expire_stale, nullif(i.concurrency_key, ''), nullif(i.concurrency_limit, 0)
	FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::bytea[], $6::int[], $7::bigint[],
		$8::timestamptz[], $9::timestamptz[], $10::text[], $11::text[], $12::bigint[], $15::text[], $16::text[], $17::text[], $18::bool[],
		$19::text[], $20::int[])
		WITH ORDINALITY AS i(id, kind, business_key, queue, payload, max_retry, timeout_ms, deadline,
			run_at, summary, trace_id, max_wait_ms, traceparent, tracestate, batch_id, expire_stale,
			concurrency_key, concurrency_limit, ord)
	ORDER BY i.ord
	ON CONFLICT (kind, business_key) DO NOTHING
	RETURNING ` + newRowColumns + `),
outbox AS (INSERT INTO keel_outbox (job_id) SELECT id FROM ins
	WHERE $14::bool AND NOT $13::bool AND published_at IS NOT NULL AND status = 'pending'),
wake AS (SELECT pg_notify('` + RelayChannel + `', '') FROM (SELECT 1 FROM ins LIMIT 1) one
	WHERE $14::bool AND ` + wakeNeeded + `)`

// bulkLookupSQL reads the rows of the given (kind, business key) pairs.
const bulkLookupSQL = `SELECT ` + JobColumns + ` FROM keel_jobs
	WHERE (kind, business_key) IN (SELECT * FROM unnest($1::text[], $2::text[]))`

// JobRows are the rows InsertJobs writes, column by column, in order.
type JobRows struct {
	IDs, Kinds, Keys, Queues  []string
	Payloads                  [][]byte
	MaxRetry                  []int32
	Timeouts, MaxWaits        []int64
	Deadlines, RunAts         []*time.Time
	Summaries, Traces         []string
	TraceParents, TraceStates []string // empty when none is traced
	Batches                   []string
	Expire                    []bool
	// ConcurrencyKeys and ConcurrencyLimits: empty when no row has a key.
	ConcurrencyKeys   []string
	ConcurrencyLimits []int32
}

// InsertJobs writes rows, skipping those whose key exists; fn sees each
// row written. claim: written published; wake: a relay publishes them.
// batches are the batches of the whole call (bulkInsertBatchSQL), nil for
// none.
func InsertJobs(ctx context.Context, db DB, r JobRows, claim, wake bool, batches []string, fn func(NewRow)) error {
	args := []any{r.IDs, r.Kinds, r.Keys, r.Queues, r.Payloads, r.MaxRetry, r.Timeouts,
		r.Deadlines, r.RunAts, r.Summaries, r.Traces, r.MaxWaits, claim, wake, r.TraceParents, r.TraceStates, r.Batches, r.Expire,
		r.ConcurrencyKeys, r.ConcurrencyLimits}
	sql := bulkInsertSQL
	if len(batches) > 0 {
		sql, args = bulkInsertBatchSQL, append(args, batches)
	}
	rows, err := db.Query(ctx, sql, args...)
	if err != nil {
		return err
	}
	defer rows.Close()
	for rows.Next() {
		var row NewRow
		if err := row.scan(rows); err != nil {
			return err
		}
		fn(row)
	}
	return rows.Err()
}

// LookupJobs reads the jobs of the (kind, business key) pairs; fn sees
// each one found.
func LookupJobs(ctx context.Context, db DB, kinds, keys []string, fn func(Job)) error {
	rows, err := db.Query(ctx, bulkLookupSQL, kinds, keys)
	if err != nil {
		return err
	}
	defer rows.Close()
	for rows.Next() {
		j, err := ScanJob(rows)
		if err != nil {
			return err
		}
		fn(j)
	}
	return rows.Err()
}

const getJobSQL = `SELECT ` + JobColumns + ` FROM keel_jobs WHERE id = $1`

// GetJob reads job id; pgx.ErrNoRows if there is none.
func GetJob(ctx context.Context, db DB, id string) (Job, error) {
	return ScanJob(db.QueryRow(ctx, getJobSQL, id))
}

const getJobsSQL = `SELECT ` + JobColumns + ` FROM keel_jobs WHERE id = ANY($1)`

// GetJobs reads the jobs ids, in no particular order.
func GetJobs(ctx context.Context, db DB, ids []string) ([]Job, error) {
	rows, err := db.Query(ctx, getJobsSQL, ids)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (Job, error) { return ScanJob(r) })
}

const lookupJobSQL = `SELECT ` + JobColumns + ` FROM keel_jobs WHERE kind = $1 AND business_key = $2`

// LookupJob reads the job of one business action; pgx.ErrNoRows if none.
func LookupJob(ctx context.Context, db DB, kind, businessKey string) (Job, error) {
	return ScanJob(db.QueryRow(ctx, lookupJobSQL, kind, businessKey))
}

const finishedAmongSQL = `SELECT id FROM keel_jobs WHERE id = ANY($1)
	AND status IN ('succeeded', 'discarded', 'cancelled')`

// FinishedAmong returns those of ids that finished for good.
func FinishedAmong(ctx context.Context, db DB, ids []string) ([]string, error) {
	rows, err := db.Query(ctx, finishedAmongSQL, ids)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

const stepsOfSQL = `SELECT job_id, name, status, result, calls, started_at, finished_at, verifiable,
	CASE WHEN status = 'started' AND call_until > now() THEN call_until END
	FROM keel_steps WHERE job_id = ANY($1) ORDER BY job_id, started_at, name`

// StepsOf reads the steps of the jobs ids, by job, in the order they
// started.
func StepsOf(ctx context.Context, db DB, ids []string) ([]StepRecord, error) {
	rows, err := db.Query(ctx, stepsOfSQL, ids)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowToStructByPos[StepRecord])
}

const markPublishedSQL = `UPDATE keel_jobs SET published_at = now()
	WHERE id = ANY($1) AND published_at IS NULL`

// MarkPublished records the jobs ids handed to Redis, where not yet.
func MarkPublished(ctx context.Context, db DB, ids []string) error {
	_, err := db.Exec(ctx, markPublishedSQL, ids)
	return err
}

const notifyRelaySQL = `SELECT pg_notify('` + RelayChannel + `', '')`

// NotifyRelay wakes the relays when db's transaction commits (NOTIFY is
// delivered at commit and dropped on rollback).
func NotifyRelay(ctx context.Context, db DB) error {
	_, err := db.Exec(ctx, notifyRelaySQL)
	return err
}
