package ledger

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
)

// Paused queues (keel_pauses, migration 0026): the ledger's record of a
// person's pause, which reconcilers apply to Redis. A job delivered from a
// queue the ledger holds paused (Redis lost the pause, or the delivery
// passed it being made) is held at its claim as a paused kind's job is
// (see kindpauses.go), and its queue's resume releases it.

// Pause is a queue a person paused.
type Pause struct {
	Queue    string
	PausedAt time.Time
	PausedBy string
	Note     string
	// Held counts the queue's jobs waiting in the ledger as paused:
	// delivered while Redis had lost the pause (Pauses only).
	Held int64
}

// pauseSQL records a pause and audits it in one statement; a queue paused
// already keeps its first record (and nothing is audited).
const pauseSQL = `WITH p AS (INSERT INTO keel_pauses (queue, paused_by, note) VALUES ($1, $2, $3)
	ON CONFLICT (queue) DO NOTHING RETURNING queue)
INSERT INTO keel_audit (job_id, action, actor, note) SELECT '', 'pause-queue:' || queue, $2, $3 FROM p`

// PauseQueue records queue as paused by actor, and reports whether it was
// not already.
func PauseQueue(ctx context.Context, db DB, queue, actor, note string) (bool, error) {
	tag, err := db.Exec(ctx, pauseSQL, queue, actor, note)
	return tag.RowsAffected() == 1, err
}

const resumeSQL = `WITH r AS (DELETE FROM keel_pauses WHERE queue = $1 RETURNING queue)
INSERT INTO keel_audit (job_id, action, actor, note) SELECT '', 'resume-queue:' || queue, $2, $3 FROM r`

// ResumeQueue deletes queue's pause, and reports whether there was one.
// Run in the transaction that lifts the pause in Redis before it commits:
// the deleted row stays locked until then (see PausesToApply). Release the
// queue's held jobs next (ReleaseQueue), in a statement of its own in the
// same transaction.
func ResumeQueue(ctx context.Context, db DB, queue, actor, note string) (bool, error) {
	tag, err := db.Exec(ctx, resumeSQL, queue, actor, note)
	return tag.RowsAffected() == 1, err
}

// releaseQueueSQL hands a resumed queue's held jobs to the relay, as
// releaseKindSQL does a kind's. One whose kind is still paused is held
// again at its claim.
const releaseQueueSQL = `UPDATE keel_jobs SET status = 'pending', published_at = NULL, updated_at = now()
	WHERE queue = $1 AND status = 'paused'`

// ReleaseQueue makes queue's held jobs pending for the relay and returns
// how many; notify the relay in the same transaction.
func ReleaseQueue(ctx context.Context, db DB, queue string) (int64, error) {
	tag, err := db.Exec(ctx, releaseQueueSQL, queue)
	return tag.RowsAffected(), err
}

// pausesSQL reads the paused queues with the number of jobs each holds,
// from the held jobs' index.
const pausesSQL = `SELECT p.queue, p.paused_at, p.paused_by, p.note,
	(SELECT count(*) FROM keel_jobs j WHERE j.status = 'paused' AND j.queue = p.queue)
	FROM keel_pauses p ORDER BY p.queue`

// Pauses returns the paused queues, by name, with the number of jobs each
// holds.
func Pauses(ctx context.Context, db DB) ([]Pause, error) {
	return pauses(ctx, db, pausesSQL)
}

const pausesToApplySQL = `SELECT queue, paused_at, paused_by, note, 0::bigint FROM keel_pauses ORDER BY queue FOR KEY SHARE`

// PausesToApply returns the paused queues as Pauses does, each row locked
// until tx ends: a resume (ResumeQueue, whose delete waits for the lock)
// then lifts the pause in Redis only after tx's holder has applied it
// there, and a holder that locks after a resume finds no row to apply.
func PausesToApply(ctx context.Context, tx pgx.Tx) ([]Pause, error) {
	return pauses(ctx, tx, pausesToApplySQL)
}

func pauses(ctx context.Context, db DB, sql string) ([]Pause, error) {
	rows, err := db.Query(ctx, sql)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowToStructByPos[Pause])
}
