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
	// Held counts the queue's jobs held in the ledger (delivered while
	// Redis had lost the pause) that its resume releases: not those whose
	// kind is paused too (Pauses only).
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

// queueHeldSQL: the held jobs of queue $1 that its resume releases, and
// pausesSQL counts: not those whose kind is paused too, which its kind's
// resume releases (all its held jobs, so a kind resumed meanwhile leaves
// none behind).
const queueHeldSQL = `keel_jobs.queue = $1 AND keel_jobs.status = 'paused'
	AND NOT EXISTS (SELECT 1 FROM keel_kind_pauses k WHERE k.kind = keel_jobs.kind)`

// releaseQueueSQL hands a resumed queue's held jobs to the relay, as
// releaseKindSQL does a kind's.
const releaseQueueSQL = `UPDATE keel_jobs SET status = 'pending', published_at = NULL, updated_at = now()
	WHERE ` + queueHeldSQL

// ReleaseQueue makes queue's held jobs pending for the relay and returns
// how many; notify the relay in the same transaction.
func ReleaseQueue(ctx context.Context, db DB, queue string) (int64, error) {
	tag, err := db.Exec(ctx, releaseQueueSQL, queue)
	return tag.RowsAffected(), err
}

// pausesSQL reads the paused queues with the number of held jobs each
// resume would release (queueHeldSQL), from the held jobs' index.
const pausesSQL = `SELECT p.queue, p.paused_at, p.paused_by, p.note,
	(SELECT count(*) FROM keel_jobs j WHERE j.queue = p.queue AND j.status = 'paused'
		AND NOT EXISTS (SELECT 1 FROM keel_kind_pauses k WHERE k.kind = j.kind))
	FROM keel_pauses p ORDER BY p.queue`

// Pauses returns the paused queues, by name, with the number of jobs each
// holds.
func Pauses(ctx context.Context, db DB) ([]Pause, error) {
	return pauses(ctx, db, pausesSQL)
}

const pausedQueuesSQL = `SELECT queue FROM keel_pauses ORDER BY queue`

// PausedQueues returns the names of the paused queues, in order, without
// counting their held jobs (the metrics' read).
func PausedQueues(ctx context.Context, db DB) ([]string, error) {
	rows, err := db.Query(ctx, pausedQueuesSQL)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

const pausesHoldingSQL = `SELECT EXISTS (SELECT 1 FROM keel_kind_pauses WHERE kind = $1),
	EXISTS (SELECT 1 FROM keel_pauses WHERE queue = $2)`

// PausesHolding reports whether kind and queue are paused: which pauses
// hold a job of theirs that the ledger holds (status paused).
func PausesHolding(ctx context.Context, db DB, kind, queue string) (kindPaused, queuePaused bool, err error) {
	err = db.QueryRow(ctx, pausesHoldingSQL, kind, queue).Scan(&kindPaused, &queuePaused)
	return kindPaused, queuePaused, err
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
