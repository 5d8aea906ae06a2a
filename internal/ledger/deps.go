package ledger

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
)

// Dependencies: a job that waits for others (keel_job_deps, migration
// 0024). Releasing a waiting job is the keel_parent_moved trigger's, in
// the transaction of its last parent's success; these are the statements
// that write a waiting job and read what it waits for.

// Parent is a job another waits for, as LockParents found it.
type Parent struct {
	ID, Kind, BusinessKey string
	Status                Status
	// EffectsIn: its handler failed after its completing InTx (dead or
	// discarded with its effects in); it met its children's dependency.
	EffectsIn bool
}

// lockParentsSQL locks the parents named by id ($1) or by (kind, business
// key) ($2, $3) in id order and marks them has_dependents, which arms the
// trigger that releases their children. The lock holds until the caller's
// transaction commits: a parent's success waits for it, so the child's
// count below cannot miss a parent succeeding meanwhile. A parent already
// marked is not written again.
const lockParentsSQL = `WITH p AS (
	SELECT id, kind, business_key, status, effects_committed_at IS NOT NULL AS effects_in, has_dependents FROM keel_jobs
	WHERE id = ANY (ARRAY (SELECT id FROM keel_jobs WHERE id = ANY($1::text[])
		UNION SELECT k.id FROM keel_jobs k JOIN unnest($2::text[], $3::text[]) AS u(kind, key)
			ON k.kind = u.kind AND k.business_key = u.key))
	ORDER BY id FOR UPDATE),
mark AS (UPDATE keel_jobs SET has_dependents = true
	WHERE id = ANY (ARRAY (SELECT id FROM p WHERE NOT has_dependents)))
SELECT id, kind, business_key, status, effects_in FROM p ORDER BY id`

// LockParents locks and marks the parents named by ids or by kinds[i],
// keys[i], and returns those that exist, in id order.
func LockParents(ctx context.Context, db DB, ids, kinds, keys []string) ([]Parent, error) {
	rows, err := db.Query(ctx, lockParentsSQL, ids, kinds, keys)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowToStructByPos[Parent])
}

// insertWaitingSQL writes a job with its parents ($17): waiting while $18
// of them have not met its dependency, else pending and, when due, in the
// relay's outbox with a wake-up, as insertWakeSQL writes it; the rows of
// the parents $23 are written met. A waiting row goes in published (see
// the migration): its release hands it to the relay.
const insertWaitingSQL = `WITH ins AS (INSERT INTO keel_jobs
	(id, kind, business_key, queue, payload, max_retry, timeout_ms, deadline, run_at, payload_summary, trace_id, max_wait_ms,
	 traceparent, tracestate, batch_id, expire_stale, status, waiting_on, workflow_id, workflow_task,
	 concurrency_key, concurrency_limit, published_at)
	VALUES ($1, $2, $3, $4, $5, $6, $7, $8, coalesce($9, now()), nullif($10, ''), nullif($11, ''), $12,
	 nullif($13, ''), nullif($14, ''), nullif($15, ''), $16,
	 CASE WHEN $18::int > 0 THEN 'waiting' ELSE 'pending' END, $18::int, nullif($19, ''), nullif($20, ''),
	 nullif($21, ''), nullif($22::int, 0),
	 CASE WHEN $18::int > 0 OR coalesce($9, now()) <= now() THEN now() END)
	ON CONFLICT (kind, business_key) DO NOTHING
	RETURNING ` + newRowColumns + `),
deps AS (INSERT INTO keel_job_deps (parent_id, child_id, met_at)
	SELECT p, ins.id, CASE WHEN p = ANY ($23::text[]) THEN now() END FROM ins, unnest($17::text[]) p
	ON CONFLICT DO NOTHING),
outbox AS (INSERT INTO keel_outbox (job_id) SELECT id FROM ins WHERE status = 'pending' AND published_at IS NOT NULL),
wake AS (SELECT pg_notify('` + RelayChannel + `', '') FROM ins WHERE status = 'pending' AND published_at IS NOT NULL)
SELECT ` + newRowColumns + ` FROM ins WHERE (SELECT count(*) FROM wake) >= 0`

// Waiting is what InsertWaiting writes besides the job's row.
type Waiting struct {
	// Parents are the ids of every parent (keel_job_deps rows).
	Parents []string
	// WaitingOn counts those not yet succeeded: 0 writes the job pending.
	WaitingOn int
	// Met are the parents whose dependency is met already: succeeded, or
	// their effects in (Parent.EffectsIn). Their rows are written met.
	Met []string
	// WorkflowID and Task place the job in a workflow (empty: none).
	WorkflowID, Task string
}

// InsertWaiting writes r with its parents unless its (kind, business key)
// exists (pgx.ErrNoRows then). Run it in the transaction that locked the
// parents (LockParents).
func InsertWaiting(ctx context.Context, db DB, r JobInsert, w Waiting) (NewRow, error) {
	var row NewRow
	err := row.scan(db.QueryRow(ctx, insertWaitingSQL, r.ID, r.Kind, r.BusinessKey, r.Queue, r.Payload,
		r.MaxRetry, r.TimeoutMS, r.Deadline, r.RunAt, r.PayloadSummary, r.TraceID, r.MaxWaitMS,
		r.TraceParent, r.TraceState, r.BatchID, r.ExpireStale, w.Parents, w.WaitingOn, w.WorkflowID, w.Task,
		r.ConcurrencyKey, r.ConcurrencyLimit, w.Met))
	return row, err
}

// Related is a job at the other end of a dependency: a parent or a child.
type Related struct {
	ID, Kind, BusinessKey string
	Status                Status
	// WaitingOn: how many of its parents have not succeeded (a child).
	WaitingOn  int
	ErrorClass string
	FinishedAt *time.Time
	// Met: the dependency is met (keel_job_deps.met_at, migration 0032):
	// the parent succeeded, or died with its effects in after it had.
	Met bool
}

// relatedJobColumns are a Related's job's; relatedColumns add its
// dependency's (d).
const (
	relatedJobColumns = `j.id, j.kind, j.business_key, j.status, j.waiting_on, coalesce(j.error_class, ''), j.finished_at`
	relatedColumns    = relatedJobColumns + `, d.met_at IS NOT NULL`
)

// parentsSQL and childrenSQL read a job's dependencies from either end. A
// parent pruned since (it succeeded long ago) has no row: it is not
// returned.
const (
	parentsSQL = `SELECT ` + relatedColumns + ` FROM keel_job_deps d JOIN keel_jobs j ON j.id = d.parent_id
	WHERE d.child_id = $1 ORDER BY j.id`
	childrenSQL = `SELECT ` + relatedColumns + ` FROM keel_job_deps d JOIN keel_jobs j ON j.id = d.child_id
	WHERE d.parent_id = $1 ORDER BY j.id`
)

// The pages of a job's dependencies (ParentsPage, ChildrenPage): parents
// not yet met first, since they are why a job waits; children in the
// order of the parent's primary key, so a page of a parent with many
// children reads only the page's jobs. The counts run only for a full page;
// children are counted from keel_job_deps alone (pruning a job deletes the
// rows where it is the child), parents with their rows (a parent pruned
// since keeps its row there). A count is read after its page, outside a
// transaction: jobs added meanwhile may make it one or two more.
const (
	parentsPageSQL = `SELECT ` + relatedColumns + ` FROM keel_job_deps d JOIN keel_jobs j ON j.id = d.parent_id
	WHERE d.child_id = $1 ORDER BY j.status = 'succeeded' OR d.met_at IS NOT NULL, j.id LIMIT $2`
	childrenPageSQL = `SELECT ` + relatedColumns + ` FROM keel_job_deps d JOIN keel_jobs j ON j.id = d.child_id
	WHERE d.parent_id = $1 ORDER BY d.child_id LIMIT $2`
	parentsCountSQL  = `SELECT count(*) FROM keel_job_deps d JOIN keel_jobs j ON j.id = d.parent_id WHERE d.child_id = $1`
	childrenCountSQL = `SELECT count(*) FROM keel_job_deps WHERE parent_id = $1`
)

// ParentsPage returns up to n of the jobs job id waits (or waited) for,
// those not succeeded first, and how many there are in all.
func ParentsPage(ctx context.Context, db DB, id string, n int) ([]Related, int, error) {
	return relatedPage(ctx, db, parentsPageSQL, parentsCountSQL, id, n)
}

// ChildrenPage returns up to n of the jobs that wait (or waited) for job
// id, in id order, and how many there are in all.
func ChildrenPage(ctx context.Context, db DB, id string, n int) ([]Related, int, error) {
	return relatedPage(ctx, db, childrenPageSQL, childrenCountSQL, id, n)
}

func relatedPage(ctx context.Context, db DB, pageSQL, countSQL, id string, n int) ([]Related, int, error) {
	rows, err := db.Query(ctx, pageSQL, id, n)
	if err != nil {
		return nil, 0, err
	}
	page, err := collectRelated(rows)
	if err != nil || len(page) < n {
		return page, len(page), err
	}
	var total int
	err = db.QueryRow(ctx, countSQL, id).Scan(&total)
	return page, max(total, len(page)), err
}

// ParentsOf returns the jobs job id waits (or waited) for, in id order.
func ParentsOf(ctx context.Context, db DB, id string) ([]Related, error) {
	return related(ctx, db, parentsSQL, id)
}

// ChildrenOf returns the jobs that wait (or waited) for job id.
func ChildrenOf(ctx context.Context, db DB, id string) ([]Related, error) {
	return related(ctx, db, childrenSQL, id)
}

func related(ctx context.Context, db DB, sql, id string) ([]Related, error) {
	rows, err := db.Query(ctx, sql, id)
	if err != nil {
		return nil, err
	}
	return collectRelated(rows)
}

// collectRelated reads Related rows, each with its business key as it was
// enqueued (a job superseded since stores it as key#id).
func collectRelated(rows pgx.Rows) ([]Related, error) {
	rs, err := pgx.CollectRows(rows, pgx.RowToStructByPos[Related])
	for i := range rs {
		rs[i].BusinessKey = OriginalKey(rs[i].BusinessKey, rs[i].ID)
	}
	return rs, err
}

// WorkflowNode is one job of a workflow with the ids of its parents.
type WorkflowNode struct {
	Related
	Task    string
	Parents []string
	// ParentsMet says, for each of Parents, whether its dependency is met.
	ParentsMet []bool
}

const workflowSQL = `SELECT ` + relatedJobColumns + `, coalesce(j.workflow_task, ''),
	ARRAY(SELECT d.parent_id FROM keel_job_deps d WHERE d.child_id = j.id ORDER BY d.parent_id),
	ARRAY(SELECT d.met_at IS NOT NULL FROM keel_job_deps d WHERE d.child_id = j.id ORDER BY d.parent_id)
	FROM keel_jobs j WHERE j.workflow_id = $1 ORDER BY j.id`

// Workflow returns the jobs of workflow id, in id order (the order they
// were written in: parents before children).
func Workflow(ctx context.Context, db DB, id string) ([]WorkflowNode, error) {
	rows, err := db.Query(ctx, workflowSQL, id)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (WorkflowNode, error) {
		var n WorkflowNode
		err := r.Scan(&n.ID, &n.Kind, &n.BusinessKey, &n.Status, &n.WaitingOn, &n.ErrorClass, &n.FinishedAt, &n.Task, &n.Parents, &n.ParentsMet)
		n.BusinessKey = OriginalKey(n.BusinessKey, n.ID)
		return n, err
	})
}

// ParentResult is a parent's result, as a job that waited for it reads it.
type ParentResult struct {
	JobResult
	Kind, BusinessKey string
	// Task is the parent's task name in its workflow ("" outside one).
	Task string
}

// parentResultsSQL reads a job's parents with their results: a result
// counts only while its job is succeeded (as readResultSQL).
const parentResultsSQL = `SELECT j.id, j.status, r.result, r.stored_at, j.kind, j.business_key, coalesce(j.workflow_task, '')
	FROM keel_job_deps d JOIN keel_jobs j ON j.id = d.parent_id
	LEFT JOIN keel_job_results r ON r.job_id = j.id AND j.status = 'succeeded'
	WHERE d.child_id = $1 ORDER BY j.id`

// ParentResults returns the parents of job id with their results, in id
// order; a parent pruned since is not returned.
func ParentResults(ctx context.Context, db DB, id string) ([]ParentResult, error) {
	rows, err := db.Query(ctx, parentResultsSQL, id)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (ParentResult, error) {
		var p ParentResult
		var result []byte
		var at *time.Time
		err := r.Scan(&p.JobID, &p.Status, &result, &at, &p.Kind, &p.BusinessKey, &p.Task)
		p.BusinessKey = OriginalKey(p.BusinessKey, p.JobID) // a parent superseded since
		if result != nil {
			p.JSON, p.StoredAt = result, *at
		}
		return p, err
	})
}
