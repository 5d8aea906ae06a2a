package ledger

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
)

// The reconciler's pass lock: one pass per ledger at a time, keyed by
// schema, so ledgers in other schemas of the same database do not wait
// for each other.
const (
	reconcileLock      = 736543490
	reconcileLockSQL   = `SELECT pg_try_advisory_lock($1::int4, hashtext(current_schema()))`
	reconcileUnlockSQL = `SELECT pg_advisory_unlock($1::int4, hashtext(current_schema()))`
)

// TryReconcileLock takes the reconciler's pass lock on the session of conn
// if no other session holds it.
func TryReconcileLock(ctx context.Context, conn DB) (bool, error) {
	var got bool
	err := conn.QueryRow(ctx, reconcileLockSQL, reconcileLock).Scan(&got)
	return got, err
}

// ReconcileUnlock lets go of the reconciler's pass lock on the session of
// conn.
func ReconcileUnlock(ctx context.Context, conn DB) error {
	_, err := conn.Exec(ctx, reconcileUnlockSQL, reconcileLock)
	return err
}

// OpenJob is a job a reconciler pass looks for in Redis.
type OpenJob struct {
	ID, Queue string
	Held      bool // a live lease: a worker runs it
}

// reconcileSQL pages through open, published jobs left alone for longer
// than the grace, by keyset on keel_jobs_open. It reads no payload: most
// jobs turn out to be in Redis. held: a live lease, so a worker runs it.
// A job on the relay's outbox is the relay's to publish, or, past the
// outbox takeover, the reconciler's (ClaimOutbox).
const reconcileSQL = `SELECT id, queue, coalesce(lease_until > coalesce($4::timestamptz, now()), false) FROM keel_jobs
	WHERE status IN ('pending', 'running', 'failed') AND published_at IS NOT NULL
	  AND updated_at < coalesce($4::timestamptz, now()) - $1 * interval '1 millisecond' AND id > $2
	  AND NOT EXISTS (SELECT 1 FROM keel_outbox o WHERE o.job_id = keel_jobs.id)
	ORDER BY id LIMIT $3`

// ReconcilePage returns up to limit open, published jobs after id after,
// in id order, left alone for longer than grace, and not on the outbox.
func ReconcilePage(ctx context.Context, db DB, grace time.Duration, after string, limit int, now Now) ([]OpenJob, error) {
	rows, err := db.Query(ctx, reconcileSQL, grace.Milliseconds(), after, limit, now)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowToStructByPos[OpenJob])
}

// Orphan is a running job whose lease ran out.
type Orphan struct {
	ID, Queue, Holder string
}

// rescueSQL finds jobs whose worker stopped renewing its lease: it died, or
// lost the ledger. It runs every second in every worker, so it stays on
// keel_jobs_running_lease (running rows only: a few per worker slot).
const rescueSQL = `SELECT id, queue, coalesce(lease_holder, '') FROM keel_jobs
	WHERE status = 'running' AND lease_until < coalesce($3::timestamptz, now()) AND id > $1
	ORDER BY id LIMIT $2`

// RescuePage returns up to limit running jobs after id after, in id order,
// whose lease has run out.
func RescuePage(ctx context.Context, db DB, after string, limit int, now Now) ([]Orphan, error) {
	rows, err := db.Query(ctx, rescueSQL, after, limit, now)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowToStructByPos[Orphan])
}

// pruneBatchesSQL deletes batches that completed longer than the retention
// ago and have no member left: pruning took the members that ended, and a
// dead one keeps its batch, which its replay would reopen. Batches with a
// dead member are skipped, not stopped at: the scan goes on past them.
const pruneBatchesSQL = `DELETE FROM keel_batches WHERE id = ANY (ARRAY (
	SELECT b.id FROM keel_batches b
	WHERE b.completed_at < coalesce($3::timestamptz, now()) - $1 * interval '1 millisecond'
	  AND NOT EXISTS (SELECT 1 FROM keel_jobs j WHERE j.batch_id = b.id)
	LIMIT $2 FOR UPDATE SKIP LOCKED))`

// PruneBatches deletes up to limit batches completed longer than
// retention ago with no member left, and returns how many.
func PruneBatches(ctx context.Context, db DB, retention time.Duration, limit int, now Now) (int, error) {
	tag, err := db.Exec(ctx, pruneBatchesSQL, retention.Milliseconds(), limit, now)
	return int(tag.RowsAffected()), err
}

const logPruneSQL = `INSERT INTO keel_prune_log (at, rows) VALUES (coalesce($2::timestamptz, now()), $1)`

// LogPrune records that a prune deleted n jobs, for the prune rate `keel
// ledger` shows.
func LogPrune(ctx context.Context, db DB, n int, now Now) error {
	_, err := db.Exec(ctx, logPruneSQL, n, now)
	return err
}

const trimPruneLogSQL = `DELETE FROM keel_prune_log WHERE at < coalesce($1::timestamptz, now()) - interval '7 days'`

// TrimPruneLog drops the prune log's entries older than 7 days.
func TrimPruneLog(ctx context.Context, db DB, now Now) error {
	_, err := db.Exec(ctx, trimPruneLogSQL, now)
	return err
}

// Death is a dead job as its alert tells of it.
type Death struct {
	ID, Kind, Queue, BusinessKey, Class, Error, TraceID string
	Attempts                                            int
}

// owedAlertsSQL reads the deaths whose worker's hook never returned (it was
// killed in between), oldest first, once they were left alone longer than
// the grace: a hook still running on its worker is not doubled.
const owedAlertsSQL = `SELECT id, kind, queue, coalesce(business_key, ''), coalesce(error_class, ''),
	coalesce(last_error, ''), coalesce(trace_id, ''), attempts FROM keel_jobs
	WHERE alert_owed AND status = 'dead' AND updated_at < coalesce($3::timestamptz, now()) - $1 * interval '1 millisecond'
	ORDER BY updated_at LIMIT $2`

// OwedAlerts returns up to limit deaths whose alert is owed, recorded more
// than grace ago.
func OwedAlerts(ctx context.Context, db DB, grace time.Duration, limit int, now Now) ([]Death, error) {
	rows, err := db.Query(ctx, owedAlertsSQL, grace.Milliseconds(), limit, now)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowToStructByPos[Death])
}

const alertsPaidSQL = `UPDATE keel_jobs SET alert_owed = false WHERE id = ANY($1) AND alert_owed`

// AlertsPaid records that the death hook ran for the jobs in ids.
func AlertsPaid(ctx context.Context, db DB, ids []string) error {
	_, err := db.Exec(ctx, alertsPaidSQL, ids)
	return err
}
