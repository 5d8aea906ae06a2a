package ledger

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

// An operator action: what a person does to jobs (the inspect package).
type Action string

// The operator actions.
const (
	Replay  Action = "replay"
	Discard Action = "discard"
	Cancel  Action = "cancel"
	// ReleaseWaiting starts a waiting job without waiting for its parents.
	ReleaseWaiting Action = "release"
)

// A verdict is what an action makes of one job: the rules live here once,
// as SQL (verdictSQL), and every path reads them: the single action, the
// bulk one, the dry run and its counts.
const (
	// VerdictOK: the action applies.
	VerdictOK = "ok"
	// VerdictAlready: nothing to do (replay: the job is no longer dead;
	// discard: discarded already; cancel: cancelled already).
	VerdictAlready = "already"
	// VerdictStatus: refused for the job's status (replay: discarded or
	// cancelled; discard: not dead; cancel: ended).
	VerdictStatus = "status"
	// VerdictDead: cancel refused: the job is dead (discard closes it).
	VerdictDead = "dead"
	// VerdictSuperseded: replay refused: a newer job of the key replaced it.
	VerdictSuperseded = "superseded"
	// VerdictEffects: replay refused: the job's completing InTx committed.
	VerdictEffects = "effects"
	// VerdictDoubt: replay refused: a step is in doubt that no Verify settles.
	VerdictDoubt = "doubt"
)

// inDoubtSQL is a step of job j in doubt that no Verify settles: a person
// says first whether its call happened.
const inDoubtSQL = `SELECT 1 FROM keel_steps s WHERE s.job_id = j.id AND s.status = 'started' AND NOT s.verifiable`

// verdictSQL is each action's verdict on the keel_jobs row j.
var verdictSQL = map[Action]string{
	Replay: `CASE WHEN j.status = 'dead' AND j.superseded_at IS NOT NULL THEN 'superseded'
		WHEN j.status IN ('discarded', 'cancelled') THEN 'status'
		WHEN j.status <> 'dead' THEN 'already'
		WHEN j.effects_committed_at IS NOT NULL THEN 'effects'
		WHEN EXISTS (` + inDoubtSQL + `) THEN 'doubt'
		ELSE 'ok' END`,
	Discard: `CASE j.status WHEN 'dead' THEN 'ok' WHEN 'discarded' THEN 'already' ELSE 'status' END`,
	Cancel: `CASE WHEN j.status IN ('waiting', 'pending', 'paused', 'running', 'failed') THEN 'ok'
		WHEN j.status = 'cancelled' THEN 'already' WHEN j.status = 'dead' THEN 'dead' ELSE 'status' END`,
	ReleaseWaiting: `CASE WHEN j.status = 'waiting' THEN 'ok'
		WHEN j.status IN ('pending', 'paused', 'running', 'failed', 'succeeded') THEN 'already' ELSE 'status' END`,
}

func verdictOf(a Action) string {
	v, ok := verdictSQL[a]
	if !ok {
		panic(fmt.Sprintf("ledger: no operator action %q", a))
	}
	return v
}

// Verdict is an action's verdict on one job, with what explaining it needs.
type Verdict struct {
	ID, Queue, Status, BusinessKey string
	ResolvedBy, ResolutionNote     string
	Verdict                        string
	// Doubt names the steps in doubt no Verify settles, in order.
	Doubt []string
}

const lockJobsSQL = `SELECT id FROM keel_jobs WHERE id = ANY($1) ORDER BY id FOR UPDATE`

// LockJobs locks the rows of the jobs ids in tx, in id order (two bulk
// actions on overlapping sets wait for each other, not deadlock). The row
// lock orders an action against the job's completion (InTx and the guard's
// mark, both conditional on the status): whichever commits first wins.
// Judge after it, in a statement of its own, sees what the lock waited for.
func LockJobs(ctx context.Context, tx DB, ids []string) error {
	rows, err := tx.Query(ctx, lockJobsSQL, ids)
	if err != nil {
		return err
	}
	rows.Close()
	return rows.Err()
}

const judgeSQL = `SELECT j.id, j.queue, j.status, j.business_key, coalesce(j.resolved_by, ''), coalesce(j.resolution_note, ''), %s,
	ARRAY(SELECT s.name FROM keel_steps s WHERE s.job_id = j.id AND s.status = 'started' AND NOT s.verifiable ORDER BY s.name)
	FROM keel_jobs j WHERE j.id = ANY($1) ORDER BY j.id`

// Judge returns action's verdict on each of the jobs ids that exists, in
// id order.
func Judge(ctx context.Context, db DB, a Action, ids []string) ([]Verdict, error) {
	rows, err := db.Query(ctx, fmt.Sprintf(judgeSQL, verdictOf(a)), ids)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (Verdict, error) {
		var v Verdict
		err := r.Scan(&v.ID, &v.Queue, &v.Status, &v.BusinessKey, &v.ResolvedBy, &v.ResolutionNote, &v.Verdict, &v.Doubt)
		return v, err
	})
}

// Acted is a job an action changed.
type Acted struct {
	ID, Queue string
	// WasRunning: a cancel found a worker holding the job.
	WasRunning bool
}

// Each action's change, for the jobs $1 whose verdict is ok, with its row
// in keel_audit in the same statement. The verdict is asked again so that
// the statement never does what the rules refuse, locked or not.
const (
	// A deadline that has passed goes: a person replaying the job wants it
	// run, and asynq would fail it unrun. The ledger row goes back to the
	// relay, which publishes it anew.
	replayJobsSQL = `WITH done AS (UPDATE keel_jobs j SET status = 'pending', attempts = 0, run_at = coalesce($4::timestamptz, now()),
		deadline = CASE WHEN deadline <= coalesce($4::timestamptz, now()) THEN NULL ELSE deadline END, in_doubt = false, alert_owed = false,
		crashes = 0, extra_runs = 0, waited_ms = 0, published_at = NULL, lease_holder = NULL, lease_until = NULL,
		finished_at = NULL, updated_at = coalesce($4::timestamptz, now())
		WHERE j.id = ANY($1) AND %s = 'ok' RETURNING j.id, j.queue, false),
	audit AS (INSERT INTO keel_audit (job_id, action, actor, note, at) SELECT id, 'replay', $2, $3, coalesce($4::timestamptz, now()) FROM done)
	SELECT * FROM done`
	discardJobsSQL = `WITH ` + keysOfSQL + `,
	done AS (UPDATE keel_jobs j SET status = 'discarded', resolution_note = $3, resolved_by = $2,
		updated_at = coalesce($4::timestamptz, now()), finished_at = coalesce($4::timestamptz, now())
		WHERE j.id = ANY($1) AND %s = 'ok' AND (SELECT count(*) FROM keys) >= 0 RETURNING j.id, j.queue, false),
	audit AS (INSERT INTO keel_audit (job_id, action, actor, note, at) SELECT id, 'discard', $2, $3, coalesce($4::timestamptz, now()) FROM done)
	SELECT * FROM done`
	// A running handler may act until its worker notices (which then
	// renews the mark while it runs) or its lease runs out: a newer job of
	// the key waits for it (stray_until). SET reads the row as it was. A
	// job held for a concurrency slot waits for none any more; the slot a
	// job in flight, or held by its kind's pause, kept goes to the next
	// held job of its key (keel_concurrency_release, migrations 0030, 0031).
	cancelJobsSQL = `WITH ` + keysOfSQL + `,
	done AS (UPDATE keel_jobs j SET status = 'cancelled', resolution_note = $3, resolved_by = $2,
		stray_until = CASE WHEN status = 'running' THEN greatest(lease_until, stray_until) ELSE stray_until END,
		lease_holder = NULL, lease_until = NULL, key_held_since = NULL, finished_at = coalesce($4::timestamptz, now()), updated_at = coalesce($4::timestamptz, now())
		FROM (SELECT id, status AS was FROM keel_jobs WHERE id = ANY($1)) old
		WHERE j.id = old.id AND %s = 'ok' AND (SELECT count(*) FROM keys) >= 0 RETURNING j.id, j.queue, old.was = 'running'),
	audit AS (INSERT INTO keel_audit (job_id, action, actor, note, at) SELECT id, 'cancel', $2, $3, coalesce($4::timestamptz, now()) FROM done)
	SELECT * FROM done`
)

// A released job goes to the relay as a replayed one does (unpublished,
// for its claim of due rows); its parents' rows stay, and their later
// success finds it no longer waiting. A job held for its concurrency key
// is let through past the key's limit: a person's override.
const releaseJobsSQL = `WITH done AS (UPDATE keel_jobs j SET status = 'pending', waiting_on = 0, published_at = NULL, key_held_since = NULL,
		updated_at = coalesce($4::timestamptz, now())
		WHERE j.id = ANY($1) AND %s = 'ok' RETURNING j.id, j.queue, false),
	audit AS (INSERT INTO keel_audit (job_id, action, actor, note, at) SELECT id, 'release', $2, $3, coalesce($4::timestamptz, now()) FROM done)
	SELECT * FROM done`

// keysOfSQL takes the concurrency keys of the jobs $1 in key order, before
// the statement's rows move: each row's triggers take its own key (its
// release, and its batch's, migrations 0030 and 0033), which, row after
// row, would take several keys in the jobs' order and deadlock with a
// round or another end taking them in key order.
const keysOfSQL = `keys AS MATERIALIZED (SELECT keel_concurrency_lock(kind, concurrency_key) FROM (
		SELECT DISTINCT kind, concurrency_key FROM keel_jobs WHERE id = ANY($1) AND concurrency_key IS NOT NULL ORDER BY 1, 2) k)`

var actSQL = map[Action]string{Replay: replayJobsSQL, Discard: discardJobsSQL, Cancel: cancelJobsSQL, ReleaseWaiting: releaseJobsSQL}

// Act does action a to those of the jobs ids it applies to, as actor with
// note, auditing each in the same statement, and returns the jobs changed.
// Run it in the transaction that locked them (LockJobs).
func Act(ctx context.Context, tx DB, a Action, ids []string, actor, note string, now Now) ([]Acted, error) {
	rows, err := tx.Query(ctx, fmt.Sprintf(actSQL[a], verdictOf(a)), ids, actor, note, now)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (Acted, error) {
		var x Acted
		err := r.Scan(&x.ID, &x.Queue, &x.WasRunning)
		return x, err
	})
}

const auditSQL = `INSERT INTO keel_audit (job_id, action, actor, note, at) VALUES ($1, $2, $3, $4, coalesce($5::timestamptz, now()))`

// Audit writes one row of the audit log: jobID is empty for what concerns
// no job (a sign-in, a queue action).
func Audit(ctx context.Context, db DB, jobID, action, actor, note string, now Now) error {
	_, err := db.Exec(ctx, auditSQL, jobID, action, actor, note, now)
	return err
}

// AuditEntry is one row of the audit log.
type AuditEntry struct {
	ID     int64
	JobID  string
	Action string
	Actor  string
	Note   string
	At     time.Time
}

const auditOfSQL = `SELECT id, job_id, action, actor, note, at FROM keel_audit WHERE job_id = $1 ORDER BY at, id`

// AuditOf returns the audit log of job jobID, oldest first.
func AuditOf(ctx context.Context, db DB, jobID string) ([]AuditEntry, error) {
	rows, err := db.Query(ctx, auditOfSQL, jobID)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (AuditEntry, error) {
		var e AuditEntry
		err := r.Scan(&e.ID, &e.JobID, &e.Action, &e.Actor, &e.Note, &e.At)
		return e, err
	})
}

const lockStatusSQL = `SELECT status FROM keel_jobs WHERE id = $1 FOR UPDATE`

// LockStatus locks job id's row in tx and returns its status.
func LockStatus(ctx context.Context, tx DB, id string) (string, error) {
	var st string
	err := tx.QueryRow(ctx, lockStatusSQL, id).Scan(&st)
	return st, err
}

const (
	stepHappenedSQL = `UPDATE keel_steps SET status = 'done', finished_at = coalesce($3::timestamptz, now())
		WHERE job_id = $1 AND name = $2 AND status = 'started'`
	// A start whose call may still be in flight (call_until ahead) is not
	// forgotten: a replay would make the call beside it.
	stepForgetSQL = `DELETE FROM keel_steps WHERE job_id = $1 AND name = $2 AND status = 'started'
		AND (call_until IS NULL OR call_until < coalesce($3::timestamptz, now()))`
)

// SettleStep records a person's verdict on step of job jobID in doubt:
// happened marks it done, otherwise its start is forgotten, unless its call
// may still be in flight. It reports whether it settled the step.
func SettleStep(ctx context.Context, tx DB, jobID, step string, happened bool, now Now) (bool, error) {
	var err error
	var n int64
	if happened {
		tag, e := tx.Exec(ctx, stepHappenedSQL, jobID, step, now)
		n, err = tag.RowsAffected(), e
	} else {
		tag, e := tx.Exec(ctx, stepForgetSQL, jobID, step, now)
		n, err = tag.RowsAffected(), e
	}
	return n > 0, err
}

const stepInFlightSQL = `SELECT coalesce(call_until > coalesce($3::timestamptz, now()), false) FROM keel_steps
	WHERE job_id = $1 AND name = $2 AND status = 'started'`

// StepInFlight says whether step of job jobID is started with its call
// possibly in flight (its call_until ahead); pgx.ErrNoRows when it is not
// started.
func StepInFlight(ctx context.Context, db DB, jobID, step string, now Now) (bool, error) {
	var in bool
	err := db.QueryRow(ctx, stepInFlightSQL, jobID, step, now).Scan(&in)
	return in, err
}

const stepStatusSQL = `SELECT status FROM keel_steps WHERE job_id = $1 AND name = $2`

// StepStatus returns the status of step of job jobID (pgx.ErrNoRows when
// none is recorded).
func StepStatus(ctx context.Context, db DB, jobID, step string) (string, error) {
	var st string
	err := db.QueryRow(ctx, stepStatusSQL, jobID, step).Scan(&st)
	return st, err
}

const auditedSQL = `SELECT EXISTS (SELECT 1 FROM keel_audit WHERE job_id = $1 AND action = $2)`

// Audited reports whether job jobID's audit log has action.
func Audited(ctx context.Context, db DB, jobID, action string) (bool, error) {
	var ok bool
	err := db.QueryRow(ctx, auditedSQL, jobID, action).Scan(&ok)
	return ok, err
}

// Filter selects jobs for a bulk action. Zero fields match everything.
type Filter struct {
	// Open selects jobs not finished, every one a cancel applies to
	// (openSQL), with Since and Until on when they were enqueued; otherwise
	// dead jobs, with Since and Until on when they died.
	Open               bool
	Kind, Queue, Class string
	Since, Until       time.Time
}

// openSQL is the jobs not finished: those waiting for a delivery, a run or
// a retry (keel_jobs_open), for their parents or a concurrency slot
// (keel_jobs_waiting), and those their kind's pause holds
// (keel_jobs_paused). Written as one arm per partial index, so that the
// planner reads each by its own; the cancel verdict takes each of them.
const openSQL = `(j.status IN ('pending', 'running', 'failed') OR j.status = 'waiting' OR j.status = 'paused')`

func (f Filter) where() (string, []any) {
	conds := []string{"j.status = 'dead'"}
	at := "j.finished_at"
	if f.Open {
		conds[0], at = openSQL, "j.created_at"
	}
	var args []any
	add := func(cond string, v any) {
		args = append(args, v)
		conds = append(conds, fmt.Sprintf(cond, len(args)))
	}
	if f.Kind != "" {
		add("j.kind = $%d", f.Kind)
	}
	if f.Queue != "" {
		add("j.queue = $%d", f.Queue)
	}
	if f.Class != "" {
		add("j.error_class = $%d", f.Class)
	}
	if !f.Since.IsZero() {
		add(at+" >= $%d", f.Since)
	}
	if !f.Until.IsZero() {
		add(at+" < $%d", f.Until)
	}
	return strings.Join(conds, " AND "), args
}

// cancelOrderSQL puts the jobs ids ($1) in the order a cancel of them in
// pages takes them: those that hold no concurrency slot (waiting: for
// parents or held by their key) first, then those a kind's pause holds
// with theirs, then the rest, each class in the order given. Ids of no job
// are left out.
const cancelOrderSQL = `SELECT j.id FROM unnest($1::text[]) WITH ORDINALITY AS u(id, n) JOIN keel_jobs j ON j.id = u.id
	ORDER BY CASE j.status WHEN 'waiting' THEN 0 WHEN 'paused' THEN 1 ELSE 2 END, u.n`

// CancelOrder returns the jobs of ids in the order a cancel in pages takes
// them (cancelOrderSQL): a job's end frees its concurrency slot and the
// oldest held job of its key goes to the relay, so one cancelled in a
// later page than a job of its key in flight could run before its page
// came. Ids of no job are left out.
func CancelOrder(ctx context.Context, db DB, ids []string) ([]string, error) {
	rows, err := db.Query(ctx, cancelOrderSQL, ids)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

// MatchingIDs returns the ids of every job f matches, oldest first (by
// death, or enqueueing), read in one statement: pages read one after
// another would skip a job that left the set meanwhile and repeat one
// when another joined it.
func MatchingIDs(ctx context.Context, db DB, f Filter) ([]string, error) {
	where, args := f.where()
	order := "j.finished_at, j.id"
	if f.Open {
		order = "j.created_at, j.id"
	}
	rows, err := db.Query(ctx, `SELECT j.id FROM keel_jobs j WHERE `+where+` ORDER BY `+order, args...)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

// CountMatching counts the jobs f matches.
func CountMatching(ctx context.Context, db DB, f Filter) (int, error) {
	where, args := f.where()
	var n int
	err := db.QueryRow(ctx, `SELECT count(*) FROM keel_jobs j WHERE `+where, args...).Scan(&n)
	return n, err
}

// ListMatching returns up to limit ids of the jobs f matches, newest
// first, skipping offset of them.
func ListMatching(ctx context.Context, db DB, f Filter, limit, offset int) ([]string, error) {
	where, args := f.where()
	order := "j.finished_at DESC, j.id"
	if f.Open {
		order = "j.created_at DESC, j.id"
	}
	args = append(args, limit, max(offset, 0))
	rows, err := db.Query(ctx, fmt.Sprintf(`SELECT j.id FROM keel_jobs j WHERE %s ORDER BY %s LIMIT $%d OFFSET $%d`,
		where, order, len(args)-1, len(args)), args...)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

// CountVerdicts counts the jobs f matches by action's verdict on each:
// a dry run's answer, by the rules the action applies.
func CountVerdicts(ctx context.Context, db DB, a Action, f Filter) (map[string]int, error) {
	where, args := f.where()
	rows, err := db.Query(ctx, `SELECT `+verdictOf(a)+`, count(*) FROM keel_jobs j WHERE `+where+` GROUP BY 1`, args...)
	if err != nil {
		return nil, err
	}
	out := map[string]int{}
	for rows.Next() {
		var v string
		var n int
		if err := rows.Scan(&v, &n); err != nil {
			rows.Close()
			return nil, err
		}
		out[v] = n
	}
	return out, rows.Err()
}

// Count is how many jobs of a kind are in a status.
type Count struct {
	Kind, Status string
	N            int
}

const countsSQL = `SELECT kind, status, count(*) FROM keel_jobs WHERE kind = ANY($1) GROUP BY kind, status ORDER BY kind, status`

const countsAllSQL = `SELECT kind, status, count(*) FROM keel_jobs GROUP BY kind, status ORDER BY kind, status`

// Counts counts the jobs of each of kinds by status; no kinds counts every
// kind, reading the whole table.
func Counts(ctx context.Context, db DB, kinds []string) ([]Count, error) {
	var rows pgx.Rows
	var err error
	if len(kinds) == 0 {
		rows, err = db.Query(ctx, countsAllSQL)
	} else {
		rows, err = db.Query(ctx, countsSQL, kinds)
	}
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (Count, error) {
		var c Count
		err := r.Scan(&c.Kind, &c.Status, &c.N)
		return c, err
	})
}

const jobStatusSQL = `SELECT status FROM keel_jobs WHERE id = $1`

// JobStatus returns job id's status (pgx.ErrNoRows for no such job).
func JobStatus(ctx context.Context, db DB, id string) (string, error) {
	var st string
	err := db.QueryRow(ctx, jobStatusSQL, id).Scan(&st)
	return st, err
}
