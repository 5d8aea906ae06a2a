package ledger

import (
	"context"
	"encoding/json"
	"time"
)

// A running job's progress and a succeeded job's result live in narrow
// tables of their own (keel_job_progress, keel_job_results), one row per
// job that has one: jobs that report no progress and store no result run
// none of these statements.

// JobProgress is a job's progress as its handler last reported it.
type JobProgress struct {
	// Run is the run that reported it: an earlier run's report stays until
	// the next run reports.
	Run         int
	Done, Total int64 // Total 0: unknown
	Note        string
	UpdatedAt   time.Time
}

// writeProgressSQL writes a report only while the run is holder's running
// run of the job: a given-up, finished or taken-over run writes nothing.
// A report of an older run never overwrites a newer run's.
const writeProgressSQL = `INSERT INTO keel_job_progress AS p (job_id, run, done, total, note, updated_at)
	SELECT id, run, $4, $5, $6, now() FROM keel_jobs
	WHERE id = $1 AND lease_holder = $2 AND run = $3 AND status = 'running'
	ON CONFLICT (job_id) DO UPDATE SET run = EXCLUDED.run, done = EXCLUDED.done, total = EXCLUDED.total,
		note = EXCLUDED.note, updated_at = EXCLUDED.updated_at
	WHERE p.run <= EXCLUDED.run`

// WriteProgress records the progress of holder's run of job id; false:
// that run no longer holds the job, nothing was written.
func WriteProgress(ctx context.Context, db DB, id, holder string, run int, done, total int64, note string) (bool, error) {
	tag, err := db.Exec(ctx, writeProgressSQL, id, holder, run, done, total, note)
	return tag.RowsAffected() == 1, err
}

const readProgressSQL = `SELECT run, done, total, note, updated_at FROM keel_job_progress WHERE job_id = $1`

// ReadProgress reads job id's last reported progress; pgx.ErrNoRows if it
// never reported any.
func ReadProgress(ctx context.Context, db DB, id string) (JobProgress, error) {
	var p JobProgress
	err := db.QueryRow(ctx, readProgressSQL, id).Scan(&p.Run, &p.Done, &p.Total, &p.Note, &p.UpdatedAt)
	return p, err
}

// JobResult is what a job's handler stored as its result, read with the
// job's status.
type JobResult struct {
	JobID  string
	Status Status
	// JSON is the result as the handler stored it; nil when the job has
	// none (it has not succeeded, or its handler stored none).
	JSON     json.RawMessage
	StoredAt time.Time
}

// Decode unmarshals the result into v.
func (r JobResult) Decode(v any) error { return json.Unmarshal(r.JSON, v) }

// storeResultSQL is sent in the completing InTx's transaction, before its
// completion mark: both commit, or neither.
const storeResultSQL = `INSERT INTO keel_job_results (job_id, result) VALUES ($1, $2)
	ON CONFLICT (job_id) DO UPDATE SET result = EXCLUDED.result, stored_at = now()`

// completeWithResultSQL marks holder's run of a job succeeded and stores
// its result in one statement, so one commits exactly when the other does:
// the completion of a run that stored a result without a completing InTx.
// (A batch member's trigger moves its batch's counters, as in a round.)
const completeWithResultSQL = `WITH m AS (` + markSucceededSQL + ` RETURNING id)
	INSERT INTO keel_job_results (job_id, result) SELECT id, $4 FROM m
	ON CONFLICT (job_id) DO UPDATE SET result = EXCLUDED.result, stored_at = now()
	RETURNING job_id`

// CompleteWithResult marks holder's run of job id succeeded together with
// its result; pgx.ErrNoRows: the run no longer holds the job, and nothing
// was written.
func CompleteWithResult(ctx context.Context, db DB, id, holder string, run int, result []byte) error {
	return db.QueryRow(ctx, completeWithResultSQL, id, holder, run, result).Scan(&id)
}

// The job's status decides whether a stored result counts (see JobResult);
// a job whose handler failed after its completing InTx has none.
const readResultSQL = `SELECT j.id, j.status, r.result, r.stored_at FROM keel_jobs j
	LEFT JOIN keel_job_results r ON r.job_id = j.id AND j.status = 'succeeded'
	WHERE j.id = $1`

const readResultByKeySQL = `SELECT j.id, j.status, r.result, r.stored_at FROM keel_jobs j
	LEFT JOIN keel_job_results r ON r.job_id = j.id AND j.status = 'succeeded'
	WHERE j.kind = $1 AND j.business_key = $2`

// ReadResult reads job id's status and result; pgx.ErrNoRows if there is
// no such job.
func ReadResult(ctx context.Context, db DB, id string) (JobResult, error) {
	return scanResult(db.QueryRow(ctx, readResultSQL, id))
}

// ReadResultByKey is ReadResult for the job of kind with business key.
func ReadResultByKey(ctx context.Context, db DB, kind, businessKey string) (JobResult, error) {
	return scanResult(db.QueryRow(ctx, readResultByKeySQL, kind, businessKey))
}

func scanResult(row interface{ Scan(...any) error }) (JobResult, error) {
	var r JobResult
	var result []byte
	var at *time.Time
	err := row.Scan(&r.JobID, &r.Status, &result, &at)
	if result != nil {
		r.JSON, r.StoredAt = result, *at
	}
	return r, err
}
