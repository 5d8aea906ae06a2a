package ledger

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
)

// The statements of a run's side mechanisms: running alone after a crash,
// given-up handlers that may still act (strays), step calls in flight,
// deadlines, and what became of a run's job while it ran.

const soloSQL = `UPDATE keel_jobs SET solo_run = run
	WHERE id = $1 AND status = 'running' AND lease_holder = $2 AND run = $3`

// MarkSolo records that holder's run of job id runs alone on its worker;
// false: the run no longer holds the job.
func MarkSolo(ctx context.Context, db DB, id, holder string, run int) (bool, error) {
	tag, err := db.Exec(ctx, soloSQL, id, holder, run)
	return tag.RowsAffected() > 0, err
}

const holderSQL = `SELECT status, coalesce(lease_holder, '') FROM keel_jobs WHERE id = $1`

// Holder reads job id's status and lease holder ("" if none).
func Holder(ctx context.Context, db DB, id string) (status Status, holder string, err error) {
	err = db.QueryRow(ctx, holderSQL, id).Scan(&status, &holder)
	return status, holder, err
}

// markStraySQL marks jobs whose given-up handlers may still act, for a
// lease ($2 ms): no newer job of their key may start meanwhile (keyFreeSQL).
const markStraySQL = `UPDATE keel_jobs SET stray_until = now() + $2 * interval '1 millisecond' WHERE id = ANY($1)`

// MarkStrays marks (or renews the marks of) the jobs ids for leaseMS.
func MarkStrays(ctx context.Context, db DB, ids []string, leaseMS int64) error {
	_, err := db.Exec(ctx, markStraySQL, ids, leaseMS)
	return err
}

const clearStraySQL = `UPDATE keel_jobs SET stray_until = NULL WHERE id = $1`

// ClearStray removes job id's mark: no handler of it may act any more.
func ClearStray(ctx context.Context, db DB, id string) error {
	_, err := db.Exec(ctx, clearStraySQL, id)
	return err
}

// renewFlightsSQL extends the call_until of holder's calls in flight
// ($2 holder, $3 lease in milliseconds) on the steps their runs still hold.
const renewFlightsSQL = `UPDATE keel_steps s SET call_until = now() + $3 * interval '1 millisecond'
	FROM unnest($1::text[], $4::text[], $5::int[]) AS f(job_id, name, run)
	WHERE s.job_id = f.job_id AND s.name = f.name AND s.run = f.run AND s.call_holder = $2 AND s.status = 'started'`

// RenewFlights keeps holder's step calls in flight (job, step name, run)
// marked as such for leaseMS.
func RenewFlights(ctx context.Context, db DB, holder string, leaseMS int64, jobIDs, names []string, runs []int32) error {
	_, err := db.Exec(ctx, renewFlightsSQL, jobIDs, holder, leaseMS, names, runs)
	return err
}

// endPastDeadlineSQL ends the jobs in $1 whose deadline comes before
// now + $2 ms while no run holds them: pending, failed, held by a kind's
// pause, or running under a lease that ran out. asynq fails a delivery past its deadline before any
// middleware runs, so no run of such a job can start any more. A kind that
// drops stale work gets a discarded row (no alert, not replayable);
// otherwise the job is dead for a person. $3 is the payload summary when
// the caller has one (the kind's redaction), else the stored one stays;
// $4 is now (nil: the database's).
const endPastDeadlineSQL = `WITH ` + keysOfSQL + `
UPDATE keel_jobs SET
	status = CASE WHEN expire_stale THEN 'discarded' ELSE 'dead' END,
	error_class = CASE WHEN expire_stale THEN 'expired' ELSE 'deadline' END,
	last_error = format('keel: its deadline (%s) passed before a run could start%s',
		to_char(deadline AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS"Z"'),
		coalesce('; the last attempt''s error: ' || last_error, '')),
	resolution_note = CASE WHEN expire_stale THEN 'expired: its kind drops work still waiting at its deadline' ELSE resolution_note END,
	resolved_by = CASE WHEN expire_stale THEN 'keel' ELSE resolved_by END,
	alert_owed = NOT expire_stale,
	payload_summary = coalesce(nullif($3, ''), payload_summary),
	lease_holder = NULL, lease_until = NULL, solo_run = -1, finished_at = now(), updated_at = now()
	WHERE id = ANY($1) AND deadline < coalesce($4::timestamptz, now()) + $2 * interval '1 millisecond'
	  AND (status IN ('pending', 'failed', 'paused') OR (status = 'running' AND lease_until < coalesce($4::timestamptz, now())))
	  AND (SELECT count(*) FROM keys) >= 0
	RETURNING id, kind, queue, business_key, error_class, last_error, coalesce(trace_id, ''), attempts, status`

// Ended is a job EndPastDeadline ended.
type Ended struct {
	Death
	Status Status // dead, or discarded (expired)
}

// EndPastDeadline ends those of ids whose deadline comes within margin of
// now while no run holds them.
func EndPastDeadline(ctx context.Context, db DB, ids []string, margin time.Duration, summary string, now Now) ([]Ended, error) {
	rows, err := db.Query(ctx, endPastDeadlineSQL, ids, margin.Milliseconds(), summary, now)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowToStructByPos[Ended])
}

const runFatesSQL = `SELECT id, status, run, coalesce(last_holder, '') FROM keel_jobs WHERE id = ANY($1)`

// RunFate is what the ledger says of a job a run held.
type RunFate struct {
	ID         string
	Status     Status
	Run        int
	LastHolder string
}

// RunFates reads what became of the jobs ids.
func RunFates(ctx context.Context, db DB, ids []string) ([]RunFate, error) {
	rows, err := db.Query(ctx, runFatesSQL, ids)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowToStructByPos[RunFate])
}

const cancelledSQL = `SELECT status = 'cancelled' FROM keel_jobs WHERE id = $1`

// Cancelled reports whether job id is cancelled.
func Cancelled(ctx context.Context, db DB, id string) (bool, error) {
	var c bool
	err := db.QueryRow(ctx, cancelledSQL, id).Scan(&c)
	return c, err
}
