package ledger

import (
	"context"
	"errors"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// The statements a worker's guard runs on a job's way through it: the
// round that claims and completes, lease renewals, and the outcomes of a
// run that did not simply succeed.

// roundSQL completes the jobs in $4 (only where this worker still holds the
// lease for the run numbered in $5) and claims the jobs in $3 (only where they
// are claimable and have budget left), in one statement and one commit. A
// claim over a running row whose lease expired counts a crash: that run
// ended without an outcome. Claims skip rows another transaction has locked
// (a handler's InTx, a relay): those are reported busy and looked at again
// later, so one long transaction cannot stall every other claim behind it.
// A job never appears in both lists (runRound sees to it): a statement may
// not update one row twice. A claim's last column is the job's batch, if
// it is a batch member.
//
// The concurrency keys of the jobs completed (keys) are locked in key
// order before their release triggers run (at the end of the statement):
// rounds, and inserts (which write rows in that order), would otherwise
// meet keys in opposite orders and deadlock. Keyless rounds lock nothing.
const roundSQL = roundCTEs + `
SELECT id, 0, 0, 0::bigint, 0::bigint, '', 0, false, NULL::timestamptz FROM done WHERE (SELECT count(*) FROM keys) >= 0
UNION ALL
SELECT id, attempts, budget, waited_ms, max_wait_ms, coalesce(batch_id, ''), run, alone, deadline FROM c`

// roundBatchSQL is roundSQL for a round that completes batch members. Each
// member's trigger updates its batch's row, at the end of the statement, in
// the order the members were updated: two rounds meeting batches A and B in
// opposite orders would deadlock. So once every member is updated (the
// ARRAY reads all of done first), the batch rows are locked in id order,
// before the triggers run. Rounds of jobs outside batches do not pay for it.
const roundBatchSQL = roundCTEs + `,
locked AS (
	SELECT id FROM keel_batches
	WHERE id = ANY (ARRAY (SELECT batch_id FROM done WHERE batch_id IS NOT NULL))
	ORDER BY id FOR UPDATE)
SELECT id, 0, 0, 0::bigint, 0::bigint, '', 0, false, NULL::timestamptz FROM done
	WHERE (SELECT count(*) FROM keys) >= 0 AND (SELECT count(*) FROM locked) >= 0
UNION ALL
SELECT id, attempts, budget, waited_ms, max_wait_ms, coalesce(batch_id, ''), run, alone, deadline FROM c`

const roundCTEs = `WITH done AS (
	UPDATE keel_jobs j SET status = 'succeeded', lease_holder = NULL,
		lease_until = NULL, finished_at = now(), updated_at = now(),
		last_error = NULL, error_class = NULL
	FROM unnest($4::text[], $5::int[]) AS d(id, run)
	WHERE j.id = d.id AND j.run = d.run AND j.status = 'running' AND j.lease_holder = $1
	RETURNING j.id, j.batch_id, j.kind, j.concurrency_key),
keys AS (
	SELECT keel_concurrency_lock(kind, concurrency_key) FROM (
		SELECT DISTINCT kind, concurrency_key FROM done WHERE concurrency_key IS NOT NULL ORDER BY 1, 2) k),
free AS (
	SELECT id, status, attempts > max_retry + extra_runs AS over, crashes > 0 AS crashed_before FROM keel_jobs
	WHERE id = ANY($3)
	  AND (status IN ('pending', 'failed') OR (status = 'running' AND lease_until < now()))
	  AND (attempts <= max_retry + extra_runs OR (` + crashedBesideOthers + `))
	  AND ` + keyFreeSQL + `
	  AND ` + notPausedSQL + `
	FOR UPDATE SKIP LOCKED),
c AS (
	UPDATE keel_jobs j SET status = 'running', lease_holder = $1, last_holder = $1,
		lease_until = now() + $2 * interval '1 millisecond',
		attempts = j.attempts + CASE WHEN free.over AND free.crashed_before THEN 0 ELSE 1 END,
		run = j.run + 1, updated_at = now(),
		crashes = j.crashes + CASE WHEN free.status = 'running' AND NOT (free.over AND free.crashed_before) THEN 1 ELSE 0 END,
		waited_ms = j.waited_ms + CASE WHEN free.over AND free.crashed_before THEN $2 ELSE 0 END,
		extra_runs = j.extra_runs + CASE WHEN free.over AND NOT free.crashed_before THEN 1 ELSE 0 END,
		published_at = coalesce(j.published_at, now())
	FROM free WHERE j.id = free.id
	RETURNING j.id, j.attempts, j.max_retry + j.extra_runs AS budget, j.waited_ms, j.max_wait_ms, j.batch_id, j.run,
		j.attempts > j.max_retry + j.extra_runs AND j.crashes > 0 AS alone, j.deadline)`

// crashedBesideOthers holds for a running job whose lease expired (its
// run ended without an outcome) and whose run was not recorded as running
// alone on its worker: the crash may have been a neighbour's. Such a job
// is not retired as a poison job when its budget is used up ("over" in the
// claim above):
//   - if it had never crashed before (so that run did not have to run
//     alone), keel adds a run to its budget, once: extra_runs;
//   - if it had (so that run had to run alone), the run died while it
//     waited for the others to finish: its handler never started, so the
//     crash was another run's (whose budget pays for it) or a kill from
//     outside. It costs the job no attempt and no crash: the lease it lost
//     counts as time waited, and the job's wait ceiling ends it if that
//     goes on (runAlone): every job ends.
//
// Either way its next run runs alone. Otherwise a job is retired only for
// a crash of a run recorded as alone (solo_run = run).
const crashedBesideOthers = `status = 'running' AND lease_until < now() AND solo_run <> run`

// RoundSQL is the statement Round runs for rounds without batch members,
// for the benchmarks that time it on a large ledger ($1 holder, $2 lease
// in milliseconds, $3 ids to claim, $4 ids to complete, $5 their runs).
const RoundSQL = roundSQL

// RoundArgs are one round's claims and completions.
type RoundArgs struct {
	Holder  string
	LeaseMS int64
	Claim   []string // never nil
	// Done are the jobs to complete, each where this holder still holds
	// the run numbered in DoneRuns.
	Done     []string
	DoneRuns []int32
	// Batch: a completion is a batch member's (roundBatchSQL).
	Batch bool
}

// Claimed is a row Round returns: a completion (only ID set) or a claim.
type Claimed struct {
	ID                  string
	Attempts, Budget    int
	WaitedMS, MaxWaitMS int64
	BatchID             string
	Run                 int
	Alone               bool
	Deadline            *time.Time
}

// Round runs one round: fn sees each completed job (by its ID only) and
// each claimed one.
func Round(ctx context.Context, db DB, a RoundArgs, fn func(Claimed)) error {
	sql := roundSQL
	if a.Batch {
		sql = roundBatchSQL
	}
	rows, err := db.Query(ctx, sql, a.Holder, a.LeaseMS, a.Claim, a.Done, a.DoneRuns)
	if err != nil {
		return err
	}
	defer rows.Close()
	// One row and one list of destinations for every row: fn gets a copy.
	var c Claimed
	dest := []any{&c.ID, &c.Attempts, &c.Budget, &c.WaitedMS, &c.MaxWaitMS, &c.BatchID, &c.Run, &c.Alone, &c.Deadline}
	for rows.Next() {
		c = Claimed{} // a nil Deadline: each row's gets its own pointer, which fn may keep
		if err := rows.Scan(dest...); err != nil {
			return err
		}
		fn(c)
	}
	return rows.Err()
}

// keyFreeSQL is the claim's condition that no older job of the same key
// (moved aside by a newer one, see supersedeSQL) has a stray that may still
// act; the claimed row is keel_jobs. Only rows with a stray are in the
// index it reads.
const keyFreeSQL = `NOT EXISTS (SELECT 1 FROM keel_jobs o WHERE o.stray_until IS NOT NULL AND o.stray_until > now()
	AND o.kind = keel_jobs.kind AND o.business_key = keel_jobs.business_key || '#' || o.id)`

// notPausedSQL is the claim's condition that neither the job's kind nor
// its queue is paused in the ledger; the claimed row is keel_jobs. asynq
// delivers nothing from a queue paused in Redis, but a Redis that lost its
// data has lost the pause until a reconciler pass puts it back, and a
// delivery can pass a pause being made. A crashed run's job (running, its
// lease expired) is claimed all the same: that run began before the pause,
// and its crash is counted as always.
const notPausedSQL = `(status = 'running' OR (NOT EXISTS (SELECT 1 FROM keel_kind_pauses p WHERE p.kind = keel_jobs.kind)
	AND NOT EXISTS (SELECT 1 FROM keel_pauses q WHERE q.queue = keel_jobs.queue)))`

// unclaimedSQL holds those of the jobs that the claim left because their
// kind or queue is paused (status 'paused', see kindpauses.go; one that
// another transaction has locked is looked at again later) and reads why
// the others could not be claimed: the rare path. The pause rows are
// locked first, so a resume's release sees these holds. One a resume is
// deleting is skipped, not waited for (the worker's claims and completions
// would wait with it, for the resume's Redis call): its job is not held,
// and its delivery, busy, is looked at again shortly.
const unclaimedSQL = `WITH a AS MATERIALIZED (SELECT kind, queue FROM keel_jobs WHERE id = ANY($1)),
p AS MATERIALIZED (SELECT kind FROM keel_kind_pauses WHERE kind = ANY (ARRAY (SELECT kind FROM a)) FOR SHARE SKIP LOCKED),
q AS MATERIALIZED (SELECT queue FROM keel_pauses WHERE queue = ANY (ARRAY (SELECT queue FROM a)) FOR SHARE SKIP LOCKED),
h AS (UPDATE keel_jobs SET status = 'paused', updated_at = now() WHERE id IN (
	SELECT id FROM keel_jobs WHERE id = ANY($1) AND status IN ('pending', 'failed')
		AND (kind IN (SELECT kind FROM p) OR queue IN (SELECT queue FROM q))
	FOR UPDATE SKIP LOCKED)
	RETURNING id)
SELECT id, CASE WHEN id IN (SELECT id FROM h) THEN 'paused' ELSE status END, attempts, coalesce(lease_until, now()),
	id NOT IN (SELECT id FROM h) AND ` + exhaustedSQL + `
	FROM keel_jobs WHERE id = ANY($1)`

// exhaustedSQL holds for a job that is claimable but whose budget runs
// that ended without an outcome have used up: it retires, it does not run.
const exhaustedSQL = `(attempts > max_retry + extra_runs
	AND (status IN ('pending', 'failed') OR (status = 'running' AND lease_until < now()))
	AND NOT (` + crashedBesideOthers + `))`

// Unclaimed is why a claim did not take.
type Unclaimed struct {
	ID         string
	Status     Status
	Attempts   int
	LeaseUntil time.Time
	// Exhausted: claimable, but runs without an outcome used its budget.
	Exhausted bool
}

// ReadUnclaimed holds those of ids whose kind or queue is paused and reads why the
// claims of ids did not take.
func ReadUnclaimed(ctx context.Context, db DB, ids []string, fn func(Unclaimed)) error {
	rows, err := db.Query(ctx, unclaimedSQL, ids)
	if err != nil {
		return err
	}
	defer rows.Close()
	for rows.Next() {
		var u Unclaimed
		if err := rows.Scan(&u.ID, &u.Status, &u.Attempts, &u.LeaseUntil, &u.Exhausted); err != nil {
			return err
		}
		fn(u)
	}
	return rows.Err()
}

// renewSQL extends the leases of a worker's running jobs and returns the
// ids still this run's: renewed, or locked right now (by the worker's own
// completion round or InTx, say) and, as last committed, still held by it.
// It never waits for a row lock, so it cannot deadlock with the statements
// that finish the same rows in another order; a locked row is renewed at
// the next tick, well inside the lease.
const renewSQL = `WITH r AS (SELECT * FROM unnest($2::text[], $3::int[]) AS r(id, run)),
mine AS (
	SELECT j.id FROM keel_jobs j JOIN r ON j.id = r.id
	WHERE j.run = r.run AND j.lease_holder = $4 AND j.status = 'running'
	FOR UPDATE OF j SKIP LOCKED),
upd AS (
	UPDATE keel_jobs j SET lease_until = now() + $1 * interval '1 millisecond'
	FROM mine WHERE j.id = mine.id
	RETURNING j.id)
SELECT id FROM upd
UNION ALL
SELECT j.id FROM keel_jobs j JOIN r ON j.id = r.id
WHERE j.run = r.run AND j.lease_holder = $4 AND j.status = 'running'
  AND NOT EXISTS (SELECT 1 FROM mine WHERE mine.id = j.id)`

// Renew extends holder's leases of the runs ids (with their run numbers)
// and returns the ids still theirs.
func Renew(ctx context.Context, db DB, holder string, leaseMS int64, ids []string, runs []int32) ([]string, error) {
	rows, err := db.Query(ctx, renewSQL, leaseMS, ids, runs, holder)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

const releaseSQL = `UPDATE keel_jobs SET status = 'pending', lease_holder = NULL, lease_until = NULL,
		attempts = attempts - 1, solo_run = -1, updated_at = now()
		WHERE id = $1 AND status = 'running' AND lease_holder = $2 AND run = $3`

// Release gives an interrupted run's job back: pending again, the attempt
// not counted, no lease.
func Release(ctx context.Context, db DB, id, holder string, run int) error {
	_, err := db.Exec(ctx, releaseSQL, id, holder, run)
	return err
}

const markSucceededSQL = `UPDATE keel_jobs SET status = 'succeeded', lease_holder = NULL, lease_until = NULL,
		last_error = NULL, error_class = NULL, finished_at = now(), updated_at = now()
		WHERE id = $1 AND status = 'running' AND lease_holder = $2 AND run = $3`

// Batcher sends statements in one round trip (a pgx.Tx).
type Batcher interface {
	SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults
}

// markAndCommitSQL is markSucceededSQL raising KL001 (keel_lease_lost) when
// the run no longer holds its job: Postgres skips what a pipeline sends
// after an error, so the COMMIT queued behind the mark never runs then.
// CASE, not OR, fixes the order; the function is volatile, so it is not
// folded in at planning.
const markAndCommitSQL = `WITH m AS (` + markSucceededSQL + ` RETURNING 1)
	SELECT CASE WHEN EXISTS (SELECT FROM m) THEN true ELSE keel_lease_lost($1::text) END`

// sqlstateLeaseLost is keel_lease_lost's error code.
const sqlstateLeaseLost = "KL001"

// ErrNotHeld means the completion mark found the run no longer holding its
// job: nothing was committed, and the transaction must be rolled back.
var ErrNotHeld = errors.New("keel: the run no longer holds its job")

// CommitUnsent wraps an error after which the completing transaction is
// known not to have committed: the mark or the COMMIT was refused, or
// nothing was sent.
type CommitUnsent struct{ Err error }

func (e *CommitUnsent) Error() string { return e.Err.Error() }
func (e *CommitUnsent) Unwrap() error { return e.Err }

// refused: Postgres refused a statement and the session goes on (severity
// ERROR). A FATAL or PANIC ends the session: a COMMIT it met may or may
// not have landed.
func refused(e *pgconn.PgError) bool {
	sev := e.SeverityUnlocalized
	if sev == "" {
		sev = e.Severity
	}
	return sev == "ERROR"
}

// MarkSucceededAndCommit records, inside the completing InTx's transaction,
// that holder's run of job id succeeded, and commits it, in one round
// trip; a result (not nil) is stored in the same transaction, ahead of the
// mark. ErrNotHeld (inside a *CommitUnsent): the run no longer holds the
// job. Any error in a *CommitUnsent means nothing committed; any other
// error came with the connection lost after the mark and the COMMIT were
// sent: the commit may or may not have landed.
func MarkSucceededAndCommit(ctx context.Context, tx Batcher, id, holder string, run int, result []byte) error {
	b := &pgx.Batch{}
	if result != nil {
		b.Queue(storeResultSQL, id, result)
	}
	b.Queue(markAndCommitSQL, id, holder, run)
	b.Queue("COMMIT")
	br := tx.SendBatch(ctx, b)
	errs := make([]error, 0, 4)
	for range b.QueuedQueries {
		_, err := br.Exec()
		errs = append(errs, err)
	}
	errs = append(errs, br.Close())
	for _, err := range errs {
		if err == nil {
			continue
		}
		if pgErr := (*pgconn.PgError)(nil); errors.As(err, &pgErr) && refused(pgErr) {
			// Postgres answered: it ran neither, or refused the COMMIT.
			if pgErr.Code == sqlstateLeaseLost {
				return &CommitUnsent{ErrNotHeld}
			}
			return &CommitUnsent{err}
		}
		if pgconn.SafeToRetry(err) {
			return &CommitUnsent{err}
		}
		return err
	}
	return nil
}

// retireCrashedSQL marks dead a job whose runs used its budget without an
// outcome. It re-checks the claim conditions: another worker may have moved it.
const retireCrashedSQL = `UPDATE keel_jobs SET status = 'dead', error_class = 'crashed', alert_owed = true,
	crashes = crashes + CASE WHEN status = 'running' THEN 1 ELSE 0 END,
	last_error = format('keel: %s of %s runs ended without an outcome (the worker died: out of memory, os.Exit, a crash, SIGKILL)%s; last held by %s; retired as a poison job',
		crashes + CASE WHEN status = 'running' THEN 1 ELSE 0 END,
		greatest(attempts, crashes + CASE WHEN status = 'running' THEN 1 ELSE 0 END),
		CASE WHEN status = 'running' AND solo_run = run THEN ', the last while it ran alone on its worker' ELSE '' END,
		coalesce(last_holder, lease_holder, 'an unknown worker')),
	lease_holder = NULL, lease_until = NULL, finished_at = now(), updated_at = now(),
	payload_summary = $2
	WHERE id = $1 AND ` + exhaustedSQL + `
	RETURNING business_key, coalesce(trace_id, ''), last_error, attempts`

// Retired is a poison job RetireCrashed retired.
type Retired struct {
	BusinessKey, TraceID, Error string
	Attempts                    int
}

// RetireCrashed marks dead a job whose runs used its budget without an
// outcome; pgx.ErrNoRows: it changed hands meanwhile.
func RetireCrashed(ctx context.Context, db DB, id, summary string) (Retired, error) {
	var r Retired
	err := db.QueryRow(ctx, retireCrashedSQL, id, summary).Scan(&r.BusinessKey, &r.TraceID, &r.Error, &r.Attempts)
	return r, err
}

// deadAfterCompleteSQL also drops the result the completing InTx stored:
// a result goes only with a success.
const deadAfterCompleteSQL = `WITH r AS (DELETE FROM keel_job_results WHERE job_id = $1)
			UPDATE keel_jobs SET status = 'dead', error_class = 'permanent', last_error = $2, alert_owed = true,
			payload_summary = $3, effects_committed_at = finished_at, updated_at = now() WHERE id = $1 AND status = 'succeeded'
			RETURNING business_key, coalesce(trace_id, '')`

// DeadAfterComplete moves a job whose handler failed after its completing
// InTx committed from succeeded to dead, its effects committed (the
// state replay refuses); it returns its business key and trace id.
func DeadAfterComplete(ctx context.Context, db DB, id, msg, summary string) (businessKey, traceID string, err error) {
	err = db.QueryRow(ctx, deadAfterCompleteSQL, id, msg, summary).Scan(&businessKey, &traceID)
	return businessKey, traceID, err
}

// failSQL records a run's failure (or wait) where holder still holds it.
const failSQL = `UPDATE keel_jobs SET status = $3, last_error = $4, error_class = $5,
	attempts = attempts - $6, lease_holder = NULL, lease_until = NULL, solo_run = -1, updated_at = now(),
	published_at = CASE WHEN $7 THEN NULL ELSE published_at END,
	run_at = CASE WHEN $8 >= 0 THEN now() + $8 * interval '1 millisecond' ELSE run_at END,
	finished_at = CASE WHEN $3 = 'dead' THEN now() ELSE NULL END,
	payload_summary = CASE WHEN $3 = 'dead' THEN $9 ELSE payload_summary END,
	trace_id = coalesce(nullif($10, ''), trace_id, nullif($13, '')),
	waited_ms = waited_ms + $12,
	in_doubt = $3 = 'dead' AND $14, alert_owed = $3 = 'dead'
	WHERE id = $1 AND status = 'running' AND lease_holder = $2 AND run = $11
	RETURNING business_key, coalesce(trace_id, '')`

// Failure is a run's outcome other than success, as Fail records it.
type Failure struct {
	ID, Holder string
	Run        int
	Status     Status // failed, dead, or pending (a wait)
	Error      string
	Class      string
	// Uncount gives the attempt back (a wait).
	Uncount int
	// Unpublish hands the job to the relay (asynq's copy is revoked).
	Unpublish bool
	// RunInMS is when it runs again, from now; negative: run_at stays.
	RunInMS int64
	Summary string // kept when dead
	// TraceID is the handler's; SpanTraceID the run's span's, if none.
	TraceID, SpanTraceID string
	WaitedMS             int64
	InDoubt              bool
}

// Fail records f; pgx.ErrNoRows: the run no longer holds the job.
func Fail(ctx context.Context, db DB, f Failure) (businessKey, traceID string, err error) {
	err = db.QueryRow(ctx, failSQL, f.ID, f.Holder, f.Status, f.Error, f.Class, f.Uncount, f.Unpublish,
		f.RunInMS, f.Summary, f.TraceID, f.Run, f.WaitedMS, f.SpanTraceID, f.InDoubt).Scan(&businessKey, &traceID)
	return businessKey, traceID, err
}
