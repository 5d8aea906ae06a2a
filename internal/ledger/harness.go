package ledger

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
)

// The benchmark harness's statements (internal/bench, `keel bench`): its
// fixtures, the counts it waits on and checks, and what it reads of
// keel_jobs' size and vacuum state. keel itself never runs them; they are
// here so that nothing outside the ledger writes SQL on keel's tables.
//
// The harness runs them on ledgers of its own. TestHarnessPlans checks the
// reads of keel_jobs that a filter narrows (counts by kind or status, the
// picks); not tested: SucceededJobs, a scan (half a ledger has succeeded;
// the harness counts a one-job ledger with it), the catalog reads, and the
// DDL, maintenance and bulk fixture inserts (TRUNCATE, VACUUM, ANALYZE,
// the fills and loads), which have no plan worth keeping.

const emptyLedgerSQL = `TRUNCATE keel_jobs, keel_outbox CASCADE`

// EmptyLedger removes every job, with its outbox row and everything else
// that refers to it (steps, audit).
func EmptyLedger(ctx context.Context, db DB) error {
	_, err := db.Exec(ctx, emptyLedgerSQL)
	return err
}

const emptyLedgerAndPruneLogSQL = `TRUNCATE keel_jobs, keel_outbox, keel_prune_log CASCADE`

// EmptyLedgerAndPruneLog is EmptyLedger that also forgets past prunes.
func EmptyLedgerAndPruneLog(ctx context.Context, db DB) error {
	_, err := db.Exec(ctx, emptyLedgerAndPruneLogSQL)
	return err
}

const fillPublishedSQL = `INSERT INTO keel_jobs (id, kind, business_key, queue, payload, max_retry, published_at)
		SELECT $1 || lpad(i::text, 8, '0'), $2, $1 || lpad(i::text, 8, '0'), $3, $4, $5, now()
		FROM generate_series(0, $6 - 1) AS i`

// FillPublished records n pending jobs as published, as Enqueue would have:
// id and business key are prefix and an 8-digit number from 0.
func FillPublished(ctx context.Context, db DB, prefix, kind, queue string, payload []byte, maxRetry, n int) error {
	_, err := db.Exec(ctx, fillPublishedSQL, prefix, kind, queue, payload, maxRetry, n)
	return err
}

const fillRoundJobsSQL = `INSERT INTO keel_jobs (id, kind, business_key, queue, payload, max_retry, published_at)
		SELECT $1 || lpad(i::text, 8, '0'), $2, $1 || lpad(i::text, 8, '0'), $3, $4, 3, now()
		FROM generate_series(0, $5 - 1) AS i`

// FillRoundJobs is FillPublished with 3 retries: the jobs the scale
// benchmark claims and completes one round at a time.
func FillRoundJobs(ctx context.Context, db DB, prefix, kind, queue string, payload []byte, n int) error {
	_, err := db.Exec(ctx, fillRoundJobsSQL, prefix, kind, queue, payload, n)
	return err
}

const fillPublishedRangeSQL = `INSERT INTO keel_jobs (id, kind, business_key, queue, payload, max_retry, published_at)
		SELECT $1 || lpad(i::text, 9, '0'), $2, $1 || lpad(i::text, 9, '0'), $3, $4, 3, now()
		FROM generate_series($5::int, $6::int - 1) AS i`

// FillPublishedRange records jobs from..to-1 as published, with 3 retries
// and 9-digit numbers, for a feeder that adds jobs in many calls.
func FillPublishedRange(ctx context.Context, db DB, prefix, kind, queue string, payload []byte, from, to int) error {
	_, err := db.Exec(ctx, fillPublishedRangeSQL, prefix, kind, queue, payload, from, to)
	return err
}

// loadFinishedSQL inserts finished jobs $1..$2-1 of $3: finish times
// spread evenly over the last 40 days (oldest first, so ids, which are
// time-ordered uuids as keel's, grow like a real ledger's); 96%
// succeeded, 1% dead, 1.5% discarded, 1.5% cancelled; random business keys
// and payloads of about 160 bytes.
const loadFinishedSQL = `INSERT INTO keel_jobs (id, kind, business_key, queue, payload, status, attempts, max_retry,
	run_at, published_at, last_error, error_class, last_holder, created_at, updated_at, finished_at)
SELECT (lpad(to_hex((extract(epoch FROM c) * 1000)::bigint), 12, '0') || '7' || substr(h, 1, 3) || '8' || substr(h, 4, 15))::uuid::text,
	k, k || ':' || substr(h, 10, 20), q,
	convert_to('{"customer_id":"cus_' || substr(h, 1, 14) || '","order_id":' || i || ',"amount_cents":' || i % 100000 ||
		',"currency":"EUR","email":"user' || i % 1000000 || '@example.com","locale":"de-DE","ref":"' || substr(h, 15, 16) || '"}', 'UTF8'),
	st, CASE st WHEN 'succeeded' THEN 1 + (i % 50 = 0)::int WHEN 'dead' THEN 11 WHEN 'cancelled' THEN 0 ELSE 1 END, 10,
	c, c,
	CASE st WHEN 'dead' THEN 'upstream returned 503: service unavailable' WHEN 'discarded' THEN 'invalid address' END,
	CASE st WHEN 'dead' THEN 'transient' WHEN 'discarded' THEN 'permanent' END,
	CASE WHEN st <> 'cancelled' THEN 'worker-' || i % 16 END,
	c, f, f
FROM generate_series($1::bigint, $2::bigint - 1) AS i,
	LATERAL (SELECT md5(i::text) AS h,
		now() - interval '40 days' * (1 - i::float8 / $3) AS f,
		(ARRAY['email:send','order:charge','invoice:render','webhook:deliver','report:build','image:resize','sms:send','search:index'])[1 + i % 8] AS k,
		CASE i % 10 WHEN 0 THEN 'critical' WHEN 1 THEN 'low' ELSE 'default' END AS q,
		CASE WHEN i % 200 < 192 THEN 'succeeded' WHEN i % 200 < 194 THEN 'dead' WHEN i % 200 < 197 THEN 'discarded' ELSE 'cancelled' END AS st) v,
	LATERAL (SELECT f - (0.05 + (i % 500) / 100.0) * interval '1 second' AS c) w`

// LoadFinished inserts finished jobs from..to-1 of total (see
// loadFinishedSQL), a chunk of a ledger of realistic shape.
func LoadFinished(ctx context.Context, db DB, from, to int, total float64) error {
	_, err := db.Exec(ctx, loadFinishedSQL, from, to, total)
	return err
}

// loadOpenSQL inserts $1 open jobs created in the last hour and left alone
// for half an hour: 60% pending (published), 30% failed waiting for their
// retry, 10% running under $2's lease that outlasts the run.
const loadOpenSQL = `INSERT INTO keel_jobs (id, kind, business_key, queue, payload, status, attempts, run, max_retry,
	run_at, published_at, lease_holder, lease_until, last_holder, last_error, error_class, created_at, updated_at)
SELECT (lpad(to_hex((extract(epoch FROM c) * 1000)::bigint), 12, '0') || '7' || substr(h, 1, 3) || '8' || substr(h, 4, 15))::uuid::text,
	k, 'open:' || substr(h, 10, 20), q,
	convert_to('{"customer_id":"cus_' || substr(h, 1, 14) || '","order_id":' || i || ',"amount_cents":' || i % 100000 ||
		',"currency":"EUR","email":"user' || i % 1000000 || '@example.com","locale":"de-DE","ref":"' || substr(h, 15, 16) || '"}', 'UTF8'),
	st, CASE st WHEN 'pending' THEN 0 WHEN 'failed' THEN 1 + i % 3 ELSE 1 END,
	CASE st WHEN 'pending' THEN 0 WHEN 'failed' THEN 1 + i % 3 ELSE 1 END, 10,
	CASE st WHEN 'failed' THEN now() + interval '1 hour' ELSE c END, c,
	CASE st WHEN 'running' THEN $2 END, CASE st WHEN 'running' THEN now() + interval '1 day' END,
	CASE WHEN st <> 'pending' THEN 'worker-' || i % 16 END,
	CASE st WHEN 'failed' THEN 'upstream returned 503: service unavailable' END,
	CASE st WHEN 'failed' THEN 'transient' END,
	c, now() - interval '30 minutes'
FROM generate_series(0, $1::bigint - 1) AS i,
	LATERAL (SELECT md5('open' || i) AS h,
		now() - interval '1 hour' + interval '30 minutes' * (i::float8 / $1) AS c,
		(ARRAY['email:send','order:charge','invoice:render','webhook:deliver','report:build','image:resize','sms:send','search:index'])[1 + i % 8] AS k,
		CASE i % 10 WHEN 0 THEN 'critical' WHEN 1 THEN 'low' ELSE 'default' END AS q,
		CASE WHEN i % 10 = 0 THEN 'running' WHEN i % 10 < 4 THEN 'failed' ELSE 'pending' END AS st) v`

// LoadOpen inserts n open jobs (see loadOpenSQL); the running ones are
// held by holder.
func LoadOpen(ctx context.Context, db DB, n int, holder string) error {
	_, err := db.Exec(ctx, loadOpenSQL, n, holder)
	return err
}

const deleteKindSQL = `DELETE FROM keel_jobs WHERE kind = $1`

// DeleteKind removes every job of kind.
func DeleteKind(ctx context.Context, db DB, kind string) error {
	_, err := db.Exec(ctx, deleteKindSQL, kind)
	return err
}

// The maintenance the harness runs itself rather than wait for autovacuum:
// statistics after a fill, and a measured VACUUM after a prune. VACUUM
// cannot run in a transaction: db is a pool or a connection.
const (
	analyzeJobsSQL       = `ANALYZE keel_jobs`
	vacuumAnalyzeJobsSQL = `VACUUM ANALYZE keel_jobs`
	vacuumJobsSQL        = `VACUUM keel_jobs`
)

// AnalyzeJobs refreshes keel_jobs' statistics.
func AnalyzeJobs(ctx context.Context, db DB) error {
	_, err := db.Exec(ctx, analyzeJobsSQL)
	return err
}

// VacuumAnalyzeJobs vacuums keel_jobs and refreshes its statistics.
func VacuumAnalyzeJobs(ctx context.Context, db DB) error {
	_, err := db.Exec(ctx, vacuumAnalyzeJobsSQL)
	return err
}

// VacuumJobs vacuums keel_jobs.
func VacuumJobs(ctx context.Context, db DB) error {
	_, err := db.Exec(ctx, vacuumJobsSQL)
	return err
}

const kindTallySQL = `SELECT count(*) FILTER (WHERE status = 'succeeded'), count(*) FILTER (WHERE status <> 'succeeded'),
		coalesce(sum(attempts), 0) FROM keel_jobs WHERE kind = $1`

// KindTally returns how many jobs of kind succeeded, how many did not, and
// their attempts.
func KindTally(ctx context.Context, db DB, kind string) (succeeded, notSucceeded, attempts int, err error) {
	err = db.QueryRow(ctx, kindTallySQL, kind).Scan(&succeeded, &notSucceeded, &attempts)
	return succeeded, notSucceeded, attempts, err
}

const succeededOfKindSQL = `SELECT count(*) FROM keel_jobs WHERE kind = $1 AND status = 'succeeded'`

// SucceededOfKind counts the succeeded jobs of kind.
func SucceededOfKind(ctx context.Context, db DB, kind string) (int, error) {
	var n int
	err := db.QueryRow(ctx, succeededOfKindSQL, kind).Scan(&n)
	return n, err
}

const (
	runningJobsSQL   = `SELECT count(*) FROM keel_jobs WHERE status = 'running'`
	succeededJobsSQL = `SELECT count(*) FROM keel_jobs WHERE status = 'succeeded'`
)

// RunningJobs counts the running jobs.
func RunningJobs(ctx context.Context, db DB) (int, error) {
	var n int
	err := db.QueryRow(ctx, runningJobsSQL).Scan(&n)
	return n, err
}

// SucceededJobs counts the succeeded jobs.
func SucceededJobs(ctx context.Context, db DB) (int, error) {
	var n int
	err := db.QueryRow(ctx, succeededJobsSQL).Scan(&n)
	return n, err
}

const unpublishedSQL = `SELECT (SELECT count(*) FROM keel_outbox) + (SELECT count(*) FROM keel_jobs WHERE published_at IS NULL)`

// Unpublished counts the jobs the relay has still to publish: on the
// outbox, or written unpublished.
func Unpublished(ctx context.Context, db DB) (int, error) {
	var n int
	err := db.QueryRow(ctx, unpublishedSQL).Scan(&n)
	return n, err
}

// Picks for the scale benchmark's EXPLAINs of a guard round: the first 50
// pending jobs, and the first 50 running under a holder's lease, by id.
const (
	firstPendingSQL = `SELECT coalesce(array_agg(id), '{}') FROM (SELECT id FROM keel_jobs
		WHERE status = 'pending' ORDER BY id LIMIT 50) p`
	firstHeldSQL = `SELECT coalesce(array_agg(id), '{}') FROM (SELECT id FROM keel_jobs
		WHERE status = 'running' AND lease_holder = $1 ORDER BY id LIMIT 50) p`
)

// FirstPending returns the ids of the first 50 pending jobs.
func FirstPending(ctx context.Context, db DB) ([]string, error) {
	var ids []string
	err := db.QueryRow(ctx, firstPendingSQL).Scan(&ids)
	return ids, err
}

// FirstHeld returns the ids of the first 50 jobs running under holder's
// lease.
func FirstHeld(ctx context.Context, db DB, holder string) ([]string, error) {
	var ids []string
	err := db.QueryRow(ctx, firstHeldSQL, holder).Scan(&ids)
	return ids, err
}

// WaitingJob is a pending or failed job, as Redis would hold it.
type WaitingJob struct {
	ID, Kind, Queue, Status string
}

const waitingJobsSQL = `SELECT id, kind, queue, status FROM keel_jobs WHERE status IN ('pending', 'failed')`

// WaitingJobs returns every pending and failed job.
func WaitingJobs(ctx context.Context, db DB) ([]WaitingJob, error) {
	rows, err := db.Query(ctx, waitingJobsSQL)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowToStructByPos[WaitingJob])
}

const reconcilableSQL = `SELECT count(*) FROM keel_jobs WHERE status IN ('pending', 'running', 'failed')
		AND published_at IS NOT NULL AND updated_at < now() - $1 * interval '1 millisecond'`

// Reconcilable counts the open, published jobs left alone for longer than
// grace: the rows a reconciler pass reads (outbox rows included).
func Reconcilable(ctx context.Context, db DB, grace time.Duration) (int, error) {
	var n int
	err := db.QueryRow(ctx, reconcilableSQL, grace.Milliseconds()).Scan(&n)
	return n, err
}

// TableSize is what keel_jobs takes on disk: its rows, heap, TOAST and
// indexes, and each index, largest first.
type TableSize struct {
	Rows, TableBytes, ToastBytes, IndexesBytes int64
	Indexes                                    []IndexSize
}

// IndexSize is one index's bytes.
type IndexSize struct {
	Name  string
	Bytes int64
}

const (
	jobsSizeSQL = `SELECT (SELECT count(*) FROM keel_jobs), pg_relation_size(c.oid),
		coalesce(pg_total_relation_size(nullif(c.reltoastrelid, 0)), 0), pg_indexes_size(c.oid)
		FROM pg_class c WHERE c.oid = 'keel_jobs'::regclass`
	jobsIndexSizesSQL = `SELECT c.relname::text, pg_relation_size(i.indexrelid) FROM pg_index i
		JOIN pg_class c ON c.oid = i.indexrelid WHERE i.indrelid = 'keel_jobs'::regclass ORDER BY 2 DESC, 1`
)

// JobsSize measures keel_jobs. It counts the rows: a scan of the table.
func JobsSize(ctx context.Context, db DB) (TableSize, error) {
	var z TableSize
	err := db.QueryRow(ctx, jobsSizeSQL).Scan(&z.Rows, &z.TableBytes, &z.ToastBytes, &z.IndexesBytes)
	if err != nil {
		return z, err
	}
	rows, err := db.Query(ctx, jobsIndexSizesSQL)
	if err != nil {
		return z, err
	}
	z.Indexes, err = pgx.CollectRows(rows, pgx.RowToStructByPos[IndexSize])
	return z, err
}

// TableStats is what pg_stat_user_tables says of keel_jobs.
type TableStats struct {
	Dead, Autovacuums, Live int64
}

const jobsStatsSQL = `SELECT n_dead_tup, autovacuum_count, n_live_tup FROM pg_stat_user_tables
		WHERE relid = 'keel_jobs'::regclass`

// JobsStats returns keel_jobs' dead and live tuples and autovacuum count,
// as the statistics last flushed them.
func JobsStats(ctx context.Context, db DB) (TableStats, error) {
	var t TableStats
	err := db.QueryRow(ctx, jobsStatsSQL).Scan(&t.Dead, &t.Autovacuums, &t.Live)
	return t, err
}

const jobsDeletedSQL = `SELECT n_tup_del FROM pg_stat_user_tables WHERE relid = 'keel_jobs'::regclass`

// JobsDeleted returns how many rows of keel_jobs were ever deleted, as the
// statistics last flushed them (about once a second).
func JobsDeleted(ctx context.Context, db DB) (int64, error) {
	var n int64
	err := db.QueryRow(ctx, jobsDeletedSQL).Scan(&n)
	return n, err
}

// Autovacuum is when autovacuum would vacuum keel_jobs.
type Autovacuum struct {
	On                     bool    // on for the server and not off for the table
	NaptimeSeconds         float64 // between two looks at a database
	Threshold, ScaleFactor float64 // due past Threshold + ScaleFactor * rows dead tuples
}

const autovacuumSQL = `SELECT current_setting('autovacuum')::bool AND coalesce(
			(SELECT NOT (reloptions @> ARRAY['autovacuum_enabled=false']) FROM pg_class WHERE oid = 'keel_jobs'::regclass), true),
		extract(epoch FROM current_setting('autovacuum_naptime')::interval),
		current_setting('autovacuum_vacuum_threshold')::float8, current_setting('autovacuum_vacuum_scale_factor')::float8`

// JobsAutovacuum returns autovacuum's settings for keel_jobs.
func JobsAutovacuum(ctx context.Context, db DB) (Autovacuum, error) {
	var a Autovacuum
	err := db.QueryRow(ctx, autovacuumSQL).Scan(&a.On, &a.NaptimeSeconds, &a.Threshold, &a.ScaleFactor)
	return a, err
}

const vacuumingSQL = `SELECT EXISTS (SELECT 1 FROM pg_stat_progress_vacuum WHERE relid = 'keel_jobs'::regclass),
			(SELECT autovacuum_count FROM pg_stat_user_tables WHERE relid = 'keel_jobs'::regclass)`

// Vacuuming says whether a vacuum of keel_jobs runs now, and how many
// autovacuums of it have finished.
func Vacuuming(ctx context.Context, db DB) (running bool, autovacuums int64, err error) {
	err = db.QueryRow(ctx, vacuumingSQL).Scan(&running, &autovacuums)
	return running, autovacuums, err
}
