package ledger

import (
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/keeljobs/keel/retry"
)

// Status is where a job stands in its life.
type Status string

// The ledger's state machine: pending → running → succeeded | failed (will
// retry) | dead (waits for a person) → replayed (pending) or discarded. A
// job not yet finished (pending, running, failed) may be cancelled.
const (
	// StatusWaiting: the job waits for its parents to succeed; nothing
	// publishes it until the last one does (see deps.go).
	StatusWaiting Status = "waiting"
	StatusPending Status = "pending"
	// StatusPaused: the job's kind or queue is paused; it waits in the
	// ledger, neither published nor claimed, until the pause ends.
	StatusPaused    Status = "paused"
	StatusRunning   Status = "running"
	StatusSucceeded Status = "succeeded"
	StatusFailed    Status = "failed"
	StatusDead      Status = "dead"
	StatusDiscarded Status = "discarded"
	StatusCancelled Status = "cancelled"
)

// Statuses are every status a job can have, in the order of a job's life.
func Statuses() []Status {
	return []Status{StatusWaiting, StatusPending, StatusPaused, StatusRunning, StatusSucceeded, StatusFailed,
		StatusDead, StatusDiscarded, StatusCancelled}
}

// Terminal reports whether the job is closed for good: nothing runs it again.
func (s Status) Terminal() bool {
	return s == StatusSucceeded || s == StatusDiscarded || s == StatusCancelled
}

// Job is one ledger row.
type Job struct {
	ID          string
	Kind        string
	BusinessKey string
	Queue       string
	Payload     []byte
	Status      Status
	Attempts    int
	MaxRetry    int
	// ExtraRuns is what keel added to the budget (MaxRetry+1 runs): 1 for
	// a job whose first crash came at its last attempt, beside other jobs
	// on its worker. It runs again alone, so that it is retired as a poison
	// job only for a crash of its own.
	ExtraRuns int
	Timeout   time.Duration
	Deadline  *time.Time
	// ExpireAtDeadline: still waiting when its deadline passes, the job is
	// discarded as expired (class expired) rather than dead (class
	// deadline); see tasks.ExpireAtDeadline.
	ExpireAtDeadline bool
	// InDoubt: the job died because a call may or may not have happened
	// (ErrInDoubt): a person must find out before it runs again.
	InDoubt bool
	RunAt   time.Time
	// PublishedAt is when the job was handed over for publishing: to
	// Redis, or, for a job EnqueueTx or EnqueueManyTx wrote, to the relay's
	// outbox in the same transaction (the relay publishes it moments after
	// the commit and leaves the row as it is). Nil: written unpublished (to
	// run later, handed back, replayed); a relay publishes it when due.
	PublishedAt    *time.Time
	LeaseHolder    string
	LeaseUntil     *time.Time
	LastError      string
	ErrorClass     string
	TraceID        string
	PayloadSummary string
	ResolutionNote string
	ResolvedBy     string
	CreatedAt      time.Time
	UpdatedAt      time.Time
	FinishedAt     *time.Time
	// SupersededAt is when a newer job of the same key replaced this
	// finished one (a kind's dedupe window, tasks.Unique, had passed). The
	// row keeps its key in BusinessKey; the ledger stores it moved aside
	// (key#id, see idempotency's supersede) so that the key names only the newer job.
	SupersededAt *time.Time
	// TraceParent and TraceState are the W3C trace context of the span
	// that enqueued the job (empty when it was not traced): its publish
	// and its runs continue that trace.
	TraceParent, TraceState string
	// BatchID is the batch the job is a member of; empty for most jobs.
	BatchID string
	// EffectsCommittedAt is when the job's completing InTx committed, set
	// only when the handler then failed: the job is dead with its local
	// effects in, and Replay refuses to run them again.
	EffectsCommittedAt *time.Time
	// WaitingOn counts the parents a waiting job still waits for (see
	// tasks.After); 0 once released.
	WaitingOn int
	// WorkflowID and WorkflowTask place the job in a workflow: the id its
	// caller gave and the job's task name in it; empty for most jobs.
	WorkflowID, WorkflowTask string
	// ConcurrencyKey is the job's key under its kind's tasks.ConcurrencyKey
	// (empty: none). KeyHeldSince is set while the job is held, waiting
	// for a slot of its key (status waiting); nil once released.
	ConcurrencyKey string
	KeyHeldSince   *time.Time
}

// HeldForKey reports whether the job waits for a slot of its concurrency
// key (not for parents).
func (j Job) HeldForKey() bool { return j.Status == StatusWaiting && j.KeyHeldSince != nil }

// OriginalKey is the business key of a superseded job whose row stores it
// moved aside as key#id (see idempotency's supersede).
func OriginalKey(stored, id string) string { return strings.TrimSuffix(stored, "#"+id) }

// StepRecord is one recorded external side effect of a job.
type StepRecord struct {
	JobID      string
	Name       string
	Status     string
	Result     []byte
	Calls      int
	StartedAt  time.Time
	FinishedAt *time.Time
	// Verifiable: the run that started the step could Verify it, so a
	// replay settles the step in doubt without a person (ResolveStep).
	Verifiable bool
	// InFlightUntil: a started step's call may still be in flight until
	// then (a worker that gave its run up renews it while the call has
	// not returned); nil otherwise.
	InFlightUntil *time.Time
}

// DefaultPolicyRetries is, for a failed job whose error is unclassified,
// how many retries the default retry policy gives it when that is fewer
// than its kind's budget: the worker's policy, not the budget, bounds them
// then. Pages that know only the default say so.
func (j Job) DefaultPolicyRetries() (int, bool) {
	n := retry.DefaultUnknownMaxRetry
	return n, j.Status == StatusFailed && j.ErrorClass == string(retry.ClassUnknown) && n < j.MaxRetry
}

const JobColumns = `id, kind, business_key, queue, payload, status, attempts, max_retry,
	timeout_ms, deadline, run_at, published_at, coalesce(lease_holder, ''), lease_until,
	coalesce(last_error, ''), coalesce(error_class, ''), coalesce(trace_id, ''),
	coalesce(payload_summary, ''), coalesce(resolution_note, ''), coalesce(resolved_by, ''),
	created_at, updated_at, finished_at, superseded_at, coalesce(traceparent, ''), coalesce(tracestate, ''),
	coalesce(batch_id, ''), effects_committed_at, extra_runs, expire_stale, in_doubt,
	waiting_on, coalesce(workflow_id, ''), coalesce(workflow_task, ''),
	coalesce(concurrency_key, ''), key_held_since`

// PublishColumns are what publishing reads of a job's row (taskMessage,
// the publish spans, PublishMany's mark): the relay's claims read only
// these, half the columns of a whole row.
const PublishColumns = `id, kind, business_key, queue, payload, status, max_retry, timeout_ms, deadline, run_at,
	published_at, coalesce(traceparent, ''), coalesce(tracestate, '')`

// ScanPublishJob scans a row of PublishColumns.
func ScanPublishJob(row pgx.Row) (Job, error) {
	var j Job
	var timeoutMS int64
	err := row.Scan(&j.ID, &j.Kind, &j.BusinessKey, &j.Queue, &j.Payload, &j.Status, &j.MaxRetry, &timeoutMS,
		&j.Deadline, &j.RunAt, &j.PublishedAt, &j.TraceParent, &j.TraceState)
	j.Timeout = time.Duration(timeoutMS) * time.Millisecond
	return j, err
}

// ScanJob scans a row of JobColumns.
func ScanJob(row pgx.Row) (Job, error) {
	var j Job
	var timeoutMS int64
	err := row.Scan(&j.ID, &j.Kind, &j.BusinessKey, &j.Queue, &j.Payload, &j.Status, &j.Attempts,
		&j.MaxRetry, &timeoutMS, &j.Deadline, &j.RunAt, &j.PublishedAt, &j.LeaseHolder, &j.LeaseUntil,
		&j.LastError, &j.ErrorClass, &j.TraceID, &j.PayloadSummary, &j.ResolutionNote, &j.ResolvedBy,
		&j.CreatedAt, &j.UpdatedAt, &j.FinishedAt, &j.SupersededAt,
		&j.TraceParent, &j.TraceState, &j.BatchID, &j.EffectsCommittedAt, &j.ExtraRuns, &j.ExpireAtDeadline, &j.InDoubt,
		&j.WaitingOn, &j.WorkflowID, &j.WorkflowTask, &j.ConcurrencyKey, &j.KeyHeldSince)
	if j.SupersededAt != nil {
		j.BusinessKey = OriginalKey(j.BusinessKey, j.ID)
	}
	j.Timeout = time.Duration(timeoutMS) * time.Millisecond
	return j, err
}
