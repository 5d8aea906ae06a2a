package ledger

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
)

// RelayChannel is the Postgres notification channel that wakes relays.
const RelayChannel = "keel_relay"

// A transaction that commits a NOTIFY holds a database-wide lock from its
// notify until its commit is flushed (PreCommit_Notify), so notifying
// writers commit one at a time. While rows keep coming a relay therefore
// stays awake and writers do not notify it. Two advisory locks on the
// ledger table say who is where (see insertWakeSQL):
//
//   - RelayAwakeLock: the awake relay holds it exclusively. A writer that
//     can take it shared knows no relay is awake, and notifies.
//   - RelaySettleLock: every writer takes it shared, before it looks at the
//     awake lock, and keeps it until its transaction ends. A relay going
//     back to sleep lets go of the awake lock, then polls on until it can
//     take this lock exclusively.
//
// Each constant is the argument list of Postgres's advisory lock functions
// for that lock, e.g. "SELECT pg_try_advisory_lock(" + RelayAwakeLock + ")";
// its second key is the ledger table's oid, so ledgers in different schemas
// of one database do not share them.
const (
	RelayAwakeLock  = `1801807212, ` + ledgerLockKey // 0x6b65656c, "keel"
	RelaySettleLock = `1801807213, ` + ledgerLockKey
)

const ledgerLockKey = `('keel_jobs'::regclass::oid::int8 & 2147483647)::int4`

// ListenRelay makes conn, a connection of its own, receive the
// notifications that wake relays.
func ListenRelay(ctx context.Context, conn DB) error {
	_, err := conn.Exec(ctx, "LISTEN "+RelayChannel)
	return err
}

// LockRelayAwake takes the awake lock on the session of conn, waiting as
// long as the session's lock_timeout lets it (lock_not_available, 55P03,
// when that runs out).
func LockRelayAwake(ctx context.Context, conn DB) error {
	_, err := conn.Exec(ctx, "SELECT pg_advisory_lock("+RelayAwakeLock+")")
	return err
}

const relayAwakeHeldSQL = `SELECT EXISTS (SELECT 1 FROM pg_locks,
			(VALUES (` + RelayAwakeLock + `)) AS k (k1, k2)
		WHERE locktype = 'advisory' AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
			AND classid = k1::int8::oid AND objid = k2::int8::oid AND objsubid = 2
			AND mode = 'ExclusiveLock' AND granted AND pid <> pg_backend_pid())`

// RelayAwakeHeld tells whether a session other than conn's holds the awake
// lock.
func RelayAwakeHeld(ctx context.Context, conn DB) (bool, error) {
	var held bool
	err := conn.QueryRow(ctx, relayAwakeHeldSQL).Scan(&held)
	return held, err
}

// TryRelayLock takes lock (RelayAwakeLock or RelaySettleLock) exclusively
// on the session of conn if it is free.
func TryRelayLock(ctx context.Context, conn DB, lock string) (bool, error) {
	var got bool
	err := conn.QueryRow(ctx, "SELECT pg_try_advisory_lock("+lock+")").Scan(&got)
	return got, err
}

// UnlockRelay lets go of lock on the session of conn and tells whether it
// held it.
func UnlockRelay(ctx context.Context, conn DB, lock string) (bool, error) {
	var held bool
	err := conn.QueryRow(ctx, "SELECT pg_advisory_unlock("+lock+")").Scan(&held)
	return held, err
}

// outboxDueSQL tells whether the outbox holds a row: all an idle poll asks,
// with a plan made once (claimOutboxSQL is planned for each run). Every
// row is due: a job to run later is written unpublished instead. By the
// index the claim reads too: a scan of the table would step over every row
// deleted since the last vacuum. Not EXISTS: Postgres drops the ORDER BY
// and LIMIT of an EXISTS subquery, and then scans the table.
const outboxDueSQL = `SELECT (SELECT queued_at FROM keel_outbox ORDER BY queued_at LIMIT 1) IS NOT NULL`

// OutboxDue tells whether the relay's outbox holds a row.
func OutboxDue(ctx context.Context, db DB) (bool, error) {
	var queued bool
	err := db.QueryRow(ctx, outboxDueSQL).Scan(&queued)
	return queued, err
}

// claimOutboxSQL takes up to $1 rows at least $2 ms old off the outbox,
// oldest first, and reads the jobs still to publish, in one statement: a
// statement that fails leaves the rows where they were (a caller that
// gives up on one that then commits leaves its jobs to the reconciler, as
// one that dies does). By ctid: the rows are locked, so their ctids hold
// until the commit, and a TID scan spares a second index look-up per row.
// A job gone or no longer pending is dropped, as is one that went back to
// unpublished since (a wait, a hand-back): that one belongs to
// ClaimUnpublished, at its run_at, since asynq may still hold its old copy.
// Each result row ends with how many rows were taken; when no job is left
// to publish, one row of NULL job columns carries it. The jobs are looked
// up by an array of ids, which the planner always answers from an index; a
// join on the ids was answered with a scan of the whole table when it
// expected many.
const claimOutboxSQL = `WITH o AS (DELETE FROM keel_outbox WHERE ctid = ANY (ARRAY (
	SELECT ctid FROM keel_outbox WHERE queued_at <= coalesce($3::timestamptz, now()) - $2 * interval '1 millisecond'
	ORDER BY queued_at LIMIT $1 FOR UPDATE SKIP LOCKED))
	RETURNING job_id),
j AS (SELECT ` + PublishColumns + ` FROM keel_jobs WHERE id = ANY (ARRAY (SELECT job_id FROM o))
	AND status = 'pending' AND published_at IS NOT NULL AND run_at <= coalesce($3::timestamptz, now()))
SELECT j.*, (SELECT count(*) FROM o) FROM (SELECT) one LEFT JOIN j ON true`

// claimUnpublishedSQL marks up to $1 due rows written unpublished as
// published.
const claimUnpublishedSQL = `UPDATE keel_jobs SET published_at = coalesce($2::timestamptz, now())
	WHERE ctid = ANY (ARRAY (
		SELECT ctid FROM keel_jobs WHERE published_at IS NULL AND status IN ('pending', 'failed') AND run_at <= coalesce($2::timestamptz, now())
		ORDER BY run_at LIMIT $1 FOR UPDATE SKIP LOCKED))
	RETURNING ` + PublishColumns

// A prepared statement's plan is made once for the connection's life,
// after a few runs, from the table as it was then: made while the ledger
// was nearly empty, the claim of unpublished rows settled on a plan that
// read every open job each time (5,006 rows read to claim 2 in
// idempotency's TestClaimsReadWhatTheyClaimHoweverManyJobsAreOpen). The
// claims are planned for every run instead, from the table as it is; they
// run only when there are rows to take, or every 50 ms.
const planEachRun = pgx.QueryExecModeExec

// ClaimOutbox takes up to limit rows that have waited at least age off the
// relay's outbox and returns the jobs among them still to publish (see
// claimOutboxSQL), and how many rows it took, which can exceed len(jobs).
// The jobs hold what publishing reads of them (PublishColumns).
func ClaimOutbox(ctx context.Context, db DB, limit int, age time.Duration, now Now) (jobs []Job, taken int, err error) {
	rows, err := db.Query(ctx, claimOutboxSQL, planEachRun, limit, age.Milliseconds(), now)
	if err != nil {
		return nil, 0, err
	}
	defer rows.Close()
	var n int64
	for rows.Next() {
		if rows.RawValues()[0] == nil { // no job to publish
			if err := rows.Scan(append(make([]any, len(rows.RawValues())-1), &n)...); err != nil {
				return nil, 0, err
			}
			continue
		}
		j, err := ScanPublishJob(withTaken{rows, &n})
		if err != nil {
			return nil, 0, err
		}
		jobs = append(jobs, j)
	}
	if err := rows.Err(); err != nil {
		return nil, 0, err
	}
	return jobs, int(n), nil
}

// withTaken scans a claimOutboxSQL row: the job, then the count taken.
type withTaken struct {
	pgx.Row
	taken *int64
}

func (r withTaken) Scan(dest ...any) error { return r.Row.Scan(append(dest, r.taken)...) }

// ClaimUnpublished marks up to limit due jobs written unpublished as
// published and returns them (their PublishColumns).
func ClaimUnpublished(ctx context.Context, db DB, limit int, now Now) ([]Job, error) {
	rows, err := db.Query(ctx, claimUnpublishedSQL, planEachRun, limit, now)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (Job, error) { return ScanPublishJob(r) })
}

// relayBacklogSQL reads how many jobs wait for a relay and for how many
// seconds the oldest has: the outbox, and the due pending rows written
// unpublished (one waits from when it last became unpublished, its
// updated_at: insert, replay, or hand-back by a worker, or from its run_at
// when that is later). A job to run later is not the relay's yet.
const relayBacklogSQL = `SELECT sum(n)::bigint, coalesce(extract(epoch FROM coalesce($1::timestamptz, now()) - min(since)), 0)::float8 FROM (
	SELECT count(*) AS n, min(queued_at) AS since FROM keel_outbox
	UNION ALL SELECT count(*), min(greatest(updated_at, run_at)) FROM keel_jobs
		WHERE published_at IS NULL AND status IN ('pending', 'failed') AND run_at <= coalesce($1::timestamptz, now())) w`

// RelayBacklog returns how many jobs wait for a relay and for how long the
// oldest has (see relayBacklogSQL).
func RelayBacklog(ctx context.Context, db DB, now Now) (n int64, oldest time.Duration, err error) {
	var secs float64
	err = db.QueryRow(ctx, relayBacklogSQL, now).Scan(&n, &secs)
	return n, time.Duration(secs * float64(time.Second)), err
}

const inOutboxSQL = `SELECT EXISTS (SELECT 1 FROM keel_outbox WHERE job_id = $1)`

// InOutbox tells whether job id waits on the relay's outbox.
func InOutbox(ctx context.Context, db DB, id string) (bool, error) {
	var in bool
	err := db.QueryRow(ctx, inOutboxSQL, id).Scan(&in)
	return in, err
}

const unpublishSQL = `UPDATE keel_jobs SET published_at = NULL
		WHERE id = ANY($1) AND status IN ('pending', 'failed')`

// Unpublish hands jobs a publisher could not publish back to the relay.
func Unpublish(ctx context.Context, db DB, ids []string) error {
	_, err := db.Exec(ctx, unpublishSQL, ids)
	return err
}
