package idempotency

import (
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/keeljobs/keel/internal/ledger"
)

// Status is where a job stands in its life: pending → running → succeeded
// | failed (will retry) | dead (waits for a person) → replayed (pending) or
// discarded; a job not yet finished may be cancelled.
type Status = ledger.Status

// The ledger's statuses.
const (
	StatusPending   = ledger.StatusPending
	StatusRunning   = ledger.StatusRunning
	StatusSucceeded = ledger.StatusSucceeded
	StatusFailed    = ledger.StatusFailed
	StatusDead      = ledger.StatusDead
	StatusDiscarded = ledger.StatusDiscarded
	StatusCancelled = ledger.StatusCancelled
)

// Job is one ledger row.
type Job = ledger.Job

// StepRecord is one recorded external side effect of a job.
type StepRecord = ledger.StepRecord

// OriginalKey is the business key of a superseded job whose row stores it
// moved aside as key#id (supersedeSQL).
func OriginalKey(stored, id string) string { return ledger.OriginalKey(stored, id) }

const jobColumns = ledger.JobColumns

func scanJob(row pgx.Row) (Job, error) { return ledger.ScanJob(row) }

// newRowColumns are what an insert returns of a row it wrote: the values
// Postgres chose (times are the server's, kept to the microsecond). The
// rest of the row is the NewJob as given (newJobRow), so an insert does
// not send back every column of every row.
const newRowColumns = `id, run_at, published_at, deadline, created_at`

// newJobRow is the Job of a row just written from nj: scan fills in the
// newRowColumns.
type newJobRow struct {
	id          string
	runAt       time.Time
	publishedAt *time.Time
	deadline    *time.Time
	createdAt   time.Time
}

func (r *newJobRow) scan(row pgx.Row) error {
	return row.Scan(&r.id, &r.runAt, &r.publishedAt, &r.deadline, &r.createdAt)
}

// job is the row as stored: what insertSQL and bulkInsertSQL write of nj.
func (r *newJobRow) job(nj NewJob) Job {
	// A copy, as a row read back would be: the caller may reuse its buffer.
	payload := append([]byte{}, nj.Payload...)
	return Job{ID: r.id, Kind: nj.Kind, BusinessKey: nj.BusinessKey, Queue: nj.Queue, Payload: payload,
		Status: StatusPending, MaxRetry: nj.MaxRetry, Timeout: time.Duration(nj.Timeout.Milliseconds()) * time.Millisecond,
		Deadline: r.deadline, RunAt: r.runAt, PublishedAt: r.publishedAt, TraceID: nj.TraceID,
		PayloadSummary: nj.PayloadSummary, CreatedAt: r.createdAt, UpdatedAt: r.createdAt,
		TraceParent: nj.TraceParent, TraceState: nj.TraceState, BatchID: nj.BatchID}
}
