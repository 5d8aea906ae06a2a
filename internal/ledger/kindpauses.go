package ledger

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
)

// Paused kinds (keel_kind_pauses, migration 0029). asynq pauses queues
// only, so keel holds a paused kind's jobs in the ledger: a job of a
// paused kind that no run holds gets the status 'paused', which nothing
// publishes or claims, until the resume hands it to the relay.
//
// A hold and a resume meet on the kind's pause row: every statement that
// holds jobs locks it (FOR SHARE) first, and the resume deletes it in one
// statement and releases the held jobs in the next, of the same
// transaction. So the release, which waits for the holders' locks, reads
// a snapshot taken after every hold of the kind committed, and a hold that
// comes after the delete finds no pause: no job is left held without one.

// KindPause is a kind a person paused, and how many of its jobs are held.
type KindPause struct {
	Kind     string
	PausedAt time.Time
	PausedBy string
	Note     string
	// Held counts the kind's jobs waiting in the ledger as paused.
	Held int64
}

const pauseKindSQL = `WITH p AS (INSERT INTO keel_kind_pauses (kind, paused_by, note) VALUES ($1, $2, $3)
	ON CONFLICT (kind) DO NOTHING RETURNING kind)
INSERT INTO keel_audit (job_id, action, actor, note) SELECT '', 'pause-kind:' || kind, $2, $3 FROM p`

// PauseKind records kind as paused by actor, and reports whether it was
// not already. Hold the kind's jobs next (HoldKind), in the same
// transaction.
func PauseKind(ctx context.Context, tx DB, kind, actor, note string) (bool, error) {
	tag, err := tx.Exec(ctx, pauseKindSQL, kind, actor, note)
	return tag.RowsAffected() == 1, err
}

// holdKindSQL holds the jobs of a paused kind that no run holds and that
// wait for a delivery (pending, or failed and waiting for a retry). Their
// copies in Redis are acknowledged unrun when delivered.
const holdKindSQL = `WITH p AS MATERIALIZED (SELECT kind FROM keel_kind_pauses WHERE kind = $1 FOR SHARE)
UPDATE keel_jobs SET status = 'paused', updated_at = now()
	WHERE kind = $1 AND status IN ('pending', 'failed') AND EXISTS (SELECT 1 FROM p)`

// HoldKind holds the waiting jobs of kind, if it is paused, and returns
// how many.
func HoldKind(ctx context.Context, db DB, kind string) (int64, error) {
	tag, err := db.Exec(ctx, holdKindSQL, kind)
	return tag.RowsAffected(), err
}

const resumeKindSQL = `WITH r AS (DELETE FROM keel_kind_pauses WHERE kind = $1 RETURNING kind)
INSERT INTO keel_audit (job_id, action, actor, note) SELECT '', 'resume-kind:' || kind, $2, $3 FROM r`

// ResumeKind deletes kind's pause, and reports whether there was one.
// Release its jobs next (ReleaseKind), in a statement of its own in the
// same transaction.
func ResumeKind(ctx context.Context, tx DB, kind, actor, note string) (bool, error) {
	tag, err := tx.Exec(ctx, resumeKindSQL, kind, actor, note)
	return tag.RowsAffected() == 1, err
}

// releaseKindSQL hands a resumed kind's held jobs to the relay, as a
// replay does: pending and unpublished, each at its run_at (a copy asynq
// still holds makes its publish a no-op). The held jobs' index finds them.
const releaseKindSQL = `UPDATE keel_jobs SET status = 'pending', published_at = NULL, updated_at = now()
	WHERE kind = $1 AND status = 'paused'`

// ReleaseKind makes kind's held jobs pending for the relay and returns
// how many; notify the relay in the same transaction.
func ReleaseKind(ctx context.Context, db DB, kind string) (int64, error) {
	tag, err := db.Exec(ctx, releaseKindSQL, kind)
	return tag.RowsAffected(), err
}

const heldPastDeadlineSQL = `SELECT id FROM keel_jobs
	WHERE status = 'paused' AND deadline IS NOT NULL AND deadline < coalesce($2::timestamptz, now())
	ORDER BY deadline LIMIT $1`

// HeldPastDeadline returns up to limit held jobs whose deadline has
// passed: no run can start them any more, so they end (EndPastDeadline)
// without waiting for their kind's resume.
func HeldPastDeadline(ctx context.Context, db DB, limit int, now Now) ([]string, error) {
	rows, err := db.Query(ctx, heldPastDeadlineSQL, limit, now)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

// kindPausesSQL reads the paused kinds with the number of jobs each holds,
// from the held jobs' index.
const kindPausesSQL = `SELECT p.kind, p.paused_at, p.paused_by, p.note,
	(SELECT count(*) FROM keel_jobs j WHERE j.kind = p.kind AND j.status = 'paused')
	FROM keel_kind_pauses p ORDER BY p.kind`

// KindPauses returns the paused kinds, by name.
func KindPauses(ctx context.Context, db DB) ([]KindPause, error) {
	rows, err := db.Query(ctx, kindPausesSQL)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowToStructByPos[KindPause])
}

// heldSQL counts the held jobs of each kind, paused or not (a kind with
// held jobs and no pause would be a fault: the metrics show it).
const heldSQL = `SELECT kind, count(*) FROM keel_jobs WHERE status = 'paused' GROUP BY kind ORDER BY kind`

// PausedByKind returns the number of jobs held by a kind's pause, of each
// kind that has any.
func PausedByKind(ctx context.Context, db DB) (map[string]int64, error) {
	rows, err := db.Query(ctx, heldSQL)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	held := map[string]int64{}
	for rows.Next() {
		var k string
		var n int64
		if err := rows.Scan(&k, &n); err != nil {
			return nil, err
		}
		held[k] = n
	}
	return held, rows.Err()
}
