package idempotency

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
)

var (
	// ErrNotDead means a replay or discard named a job that is not (or no
	// longer) in the dead letters and cannot be moved that way.
	ErrNotDead = errors.New("keel: job is not dead")
	// ErrNoteRequired means a discard came without a note saying why.
	ErrNoteRequired = errors.New("keel: discarding a job needs a note saying why")
	// ErrActorRequired means an operator action did not say who took it.
	ErrActorRequired = errors.New("keel: operator actions need an actor (who did it)")
	// ErrStepsInDoubt means a replay was refused because a step of the job is
	// in doubt: a person must first say whether its call happened.
	ErrStepsInDoubt = errors.New("keel: job has steps in doubt; say first whether each call happened (on its dashboard page, with `keel dead resolve`, or Store.ResolveStep)")
	// ErrEffectsCommitted means a replay was refused because the job's
	// completing InTx committed before its handler failed: its local
	// effects are in, and running the handler again would repeat them.
	ErrEffectsCommitted = errors.New("keel: the job's completing InTx committed before its handler failed; its local effects are in and a replay would run them again: finish what came after by hand, then discard it with a note")
	// ErrTaskActive means a replay or discard found asynq still holding the
	// job's task as running; it can act once asynq takes the task back.
	ErrTaskActive = errors.New("keel: asynq still holds the job's task as running")
	// ErrCountChanged means a bulk action's confirmed count no longer matches.
	ErrCountChanged = errors.New("keel: the number of matching jobs changed since it was confirmed")
)

// AuditEntry is one action a person took on a job.
type AuditEntry struct {
	ID     int64
	JobID  string
	Action string
	Actor  string
	Note   string
	At     time.Time
}

// ReplayResult says what a replay did.
type ReplayResult struct {
	Job Job
	// AlreadyReplayed is true when the job was no longer dead (an earlier
	// replay won); nothing was changed.
	AlreadyReplayed bool
}

// Replay runs a dead job again, through the same middleware and handler,
// with a fresh retry budget. It removes asynq's archived copy (whose retry
// count is spent) and hands the ledger row back to the relay, which
// publishes it anew from the ledger — so it works even after asynq's archive
// dropped the task. insp may be nil when Redis holds nothing to clean up.
// Replaying a job that is no longer dead is a no-op (AlreadyReplayed).
func (s *Store) Replay(ctx context.Context, insp *asynq.Inspector, id, actor, note string) (ReplayResult, error) {
	if strings.TrimSpace(actor) == "" {
		return ReplayResult{}, ErrActorRequired
	}
	var res ReplayResult
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		j, err := scanJob(tx.QueryRow(ctx, `SELECT `+jobColumns+` FROM keel_jobs WHERE id = $1 FOR UPDATE`, id))
		if err != nil {
			return interpretError(err)
		}
		if res, err = replayable(ctx, tx, j); err != nil || res.AlreadyReplayed {
			return err
		}
		// The archived task still reserves the id in Redis; without removing
		// it the new publish would be a silent conflict.
		if insp != nil {
			if err := deleteTask(insp, j.Queue, id); err != nil {
				return err
			}
		}
		// A deadline that has passed goes: a person replaying the job
		// wants it run, and asynq would fail it unrun.
		j, err = scanJob(tx.QueryRow(ctx, `UPDATE keel_jobs SET status = 'pending', attempts = 0, run_at = now(),
			deadline = CASE WHEN deadline <= now() THEN NULL ELSE deadline END, in_doubt = false,
			crashes = 0, extra_runs = 0, waited_ms = 0, published_at = NULL, lease_holder = NULL, lease_until = NULL, finished_at = NULL, updated_at = now()
			WHERE id = $1 RETURNING `+jobColumns, id))
		if err != nil {
			return interpretError(err)
		}
		if err := audit(ctx, tx, id, "replay", actor, note); err != nil {
			return err
		}
		res = ReplayResult{Job: j}
		return NotifyRelay(ctx, tx)
	})
	return res, err
}

// deleteTask removes asynq's copy of job id, if any. A task asynq holds as
// running cannot be removed: a worker that died running it holds it until
// asynq's lease on it lapses and asynq takes it back.
func deleteTask(insp *asynq.Inspector, queue, id string) error {
	err := insp.DeleteTask(queue, id)
	if err == nil || errors.Is(err, asynq.ErrTaskNotFound) || errors.Is(err, asynq.ErrQueueNotFound) {
		return nil
	}
	if info, ierr := insp.GetTaskInfo(queue, id); ierr == nil && info.State == asynq.TaskStateActive {
		return fmt.Errorf("%w (job %s; the worker that ran it may have died, and asynq takes the task back once "+
			"its lease lapses, within about a minute): try again then", ErrTaskActive, id)
	}
	return fmt.Errorf("keel: remove the task of job %s from asynq: %w", id, err)
}

// CheckReplay is what Replay would do with job id now, changing nothing:
// an error for a job it refuses, AlreadyReplayed for one with nothing to
// do (a dry run's answer).
func (s *Store) CheckReplay(ctx context.Context, id string) (ReplayResult, error) {
	j, err := s.Get(ctx, id)
	if err != nil {
		return ReplayResult{}, err
	}
	return replayable(ctx, s.pool, j)
}

// replayable is Replay's verdict on j: it refuses a job superseded,
// discarded or cancelled, one whose effects committed, and one with steps
// in doubt that no Verify can settle (a person says first); a job no
// longer dead otherwise has nothing to replay.
func replayable(ctx context.Context, db DB, j Job) (ReplayResult, error) {
	switch {
	case j.Status == StatusDead && j.SupersededAt != nil:
		return ReplayResult{}, fmt.Errorf("%w: job %s was superseded by a newer job of key %q (its kind's tasks.Unique window had passed); enqueue anew instead",
			ErrNotDead, j.ID, j.BusinessKey)
	case j.Status == StatusDead:
	case j.Status == StatusDiscarded || j.Status == StatusCancelled:
		return ReplayResult{}, fmt.Errorf("%w: job %s was %s", ErrNotDead, j.ID, j.Status)
	default:
		return ReplayResult{Job: j, AlreadyReplayed: true}, nil
	}
	if j.EffectsCommittedAt != nil {
		return ReplayResult{}, fmt.Errorf("%w (job %s)", ErrEffectsCommitted, j.ID)
	}
	rows, err := db.Query(ctx, `SELECT name FROM keel_steps WHERE job_id = $1 AND status = 'started' AND NOT verifiable ORDER BY name`, j.ID)
	if err != nil {
		return ReplayResult{}, interpretError(err)
	}
	doubt, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return ReplayResult{}, interpretError(err)
	}
	if len(doubt) > 0 {
		return ReplayResult{}, fmt.Errorf("%w: %s", ErrStepsInDoubt, strings.Join(doubt, ", "))
	}
	return ReplayResult{Job: j}, nil
}

// unreplayableSQL selects the dead jobs replayable refuses, as it judges
// them (TestCountUnreplayableAgreesWithReplay keeps the two together):
// superseded, effects committed, or a step in doubt no Verify settles.
const unreplayableSQL = `(superseded_at IS NOT NULL OR effects_committed_at IS NOT NULL
	OR EXISTS (SELECT 1 FROM keel_steps s WHERE s.job_id = keel_jobs.id AND s.status = 'started' AND NOT s.verifiable))`

// CountUnreplayable counts the dead jobs f matches that a replay would
// refuse: a bulk replay's confirm page says how many stay dead.
func (s *Store) CountUnreplayable(ctx context.Context, f DeadFilter) (int, error) {
	where, args := f.where()
	var n int
	err := s.pool.QueryRow(ctx, `SELECT count(*) FROM keel_jobs WHERE `+where+` AND `+unreplayableSQL, args...).Scan(&n)
	return n, interpretError(err)
}

// CheckDiscard is what Discard would do with job id now, changing
// nothing: an error for a job it refuses, already for one discarded
// before (whose resolution stays).
func (s *Store) CheckDiscard(ctx context.Context, id string) (j Job, already bool, err error) {
	if j, err = s.Get(ctx, id); err != nil {
		return j, false, err
	}
	already, err = discardable(j)
	return j, already, err
}

// discardable is Discard's verdict on j: a dead job is discarded, a
// discarded one is left as it is, any other refused.
func discardable(j Job) (already bool, err error) {
	switch j.Status {
	case StatusDiscarded:
		return true, nil
	case StatusDead:
		return false, nil
	}
	return false, fmt.Errorf("%w: job %s is %s", ErrNotDead, j.ID, j.Status)
}

// Discard closes a dead job for good, with a required note saying why and
// who did it. Discarding a job that is already discarded is a no-op.
func (s *Store) Discard(ctx context.Context, insp *asynq.Inspector, id, actor, note string) (Job, error) {
	if strings.TrimSpace(actor) == "" {
		return Job{}, ErrActorRequired
	}
	if strings.TrimSpace(note) == "" {
		return Job{}, ErrNoteRequired
	}
	var out Job
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		j, err := scanJob(tx.QueryRow(ctx, `SELECT `+jobColumns+` FROM keel_jobs WHERE id = $1 FOR UPDATE`, id))
		if err != nil {
			return interpretError(err)
		}
		if already, err := discardable(j); err != nil {
			return err
		} else if already {
			out = j
			return nil
		}
		out, err = scanJob(tx.QueryRow(ctx, `UPDATE keel_jobs SET status = 'discarded', resolution_note = $2,
			resolved_by = $3, updated_at = now(), finished_at = now() WHERE id = $1 RETURNING `+jobColumns, id, note, actor))
		if err != nil {
			return interpretError(err)
		}
		return audit(ctx, tx, id, "discard", actor, note)
	})
	if err == nil && insp != nil && out.Status == StatusDiscarded {
		// Best effort: the ledger is the record; asynq's copy is clutter.
		_ = insp.DeleteTask(out.Queue, id)
	}
	return out, err
}

// ResolveStep records a person's verdict on a step in doubt: happened =
// true marks it done (a replay skips it), false forgets the start (a replay
// calls it again, with the same idempotency key).
func (s *Store) ResolveStep(ctx context.Context, jobID, step string, happened bool, actor, note string) error {
	if strings.TrimSpace(actor) == "" {
		return ErrActorRequired
	}
	return pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		// Only a dead job's steps: a running job's step may be in flight, and
		// forgetting its start would let the call happen twice.
		var status Status
		if err := tx.QueryRow(ctx, `SELECT status FROM keel_jobs WHERE id = $1 FOR UPDATE`, jobID).Scan(&status); err != nil {
			return interpretError(err)
		}
		if status != StatusDead {
			return fmt.Errorf("%w: job %s is %s; steps are resolved on dead jobs only", ErrNotDead, jobID, status)
		}
		var tag interface{ RowsAffected() int64 }
		var err error
		action := "step-happened"
		if happened {
			tag, err = tx.Exec(ctx, `UPDATE keel_steps SET status = 'done', finished_at = now()
				WHERE job_id = $1 AND name = $2 AND status = 'started'`, jobID, step)
		} else {
			action = "step-not-happened"
			tag, err = tx.Exec(ctx, `DELETE FROM keel_steps WHERE job_id = $1 AND name = $2 AND status = 'started'`, jobID, step)
		}
		if err != nil {
			return interpretError(err)
		}
		if tag.RowsAffected() == 0 {
			var cur string
			err := tx.QueryRow(ctx, `SELECT status FROM keel_steps WHERE job_id = $1 AND name = $2`, jobID, step).Scan(&cur)
			switch {
			case err == nil && cur == "done" && happened:
				return nil // already so: said twice, or it finished
			case err == nil && cur == "done":
				return fmt.Errorf("%w: step %q of job %s is done, not in doubt (said to have happened, or it finished)", ErrNotFound, step, jobID)
			case errors.Is(err, pgx.ErrNoRows) && !happened:
				// Said not to have happened before, and nothing ran since:
				// said twice, as for happened above.
				var said bool
				if err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM keel_audit WHERE job_id = $1 AND action = $2)`,
					jobID, "step-not-happened:"+step).Scan(&said); err != nil {
					return interpretError(err)
				}
				if said {
					return nil
				}
				return fmt.Errorf("%w: no step %q recorded for job %s (never started)", ErrNotFound, step, jobID)
			case err == nil || errors.Is(err, pgx.ErrNoRows):
				return fmt.Errorf("%w: no step %q recorded for job %s (never started, or forgotten already)", ErrNotFound, step, jobID)
			}
			return interpretError(err)
		}
		return audit(ctx, tx, jobID, action+":"+step, actor, note)
	})
}

func audit(ctx context.Context, tx pgx.Tx, jobID, action, actor, note string) error {
	_, err := tx.Exec(ctx, `INSERT INTO keel_audit (job_id, action, actor, note) VALUES ($1, $2, $3, $4)`, jobID, action, actor, note)
	return interpretError(err)
}

// Audit returns the actions people took on a job, oldest first.
func (s *Store) Audit(ctx context.Context, jobID string) ([]AuditEntry, error) {
	rows, err := s.pool.Query(ctx, `SELECT id, job_id, action, actor, note, at FROM keel_audit WHERE job_id = $1 ORDER BY at, id`, jobID)
	if err != nil {
		return nil, interpretError(err)
	}
	es, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (AuditEntry, error) {
		var e AuditEntry
		err := r.Scan(&e.ID, &e.JobID, &e.Action, &e.Actor, &e.Note, &e.At)
		return e, err
	})
	return es, interpretError(err)
}

// DeadFilter selects dead jobs. Zero fields match everything.
type DeadFilter struct {
	Kind, Queue, Class string
	Since, Until       time.Time // on the time the job died
}

func (f DeadFilter) where() (string, []any) {
	conds := []string{"status = 'dead'"}
	var args []any
	add := func(cond string, v any) {
		args = append(args, v)
		conds = append(conds, fmt.Sprintf(cond, len(args)))
	}
	if f.Kind != "" {
		add("kind = $%d", f.Kind)
	}
	if f.Queue != "" {
		add("queue = $%d", f.Queue)
	}
	if f.Class != "" {
		add("error_class = $%d", f.Class)
	}
	if !f.Since.IsZero() {
		add("finished_at >= $%d", f.Since)
	}
	if !f.Until.IsZero() {
		add("finished_at < $%d", f.Until)
	}
	return strings.Join(conds, " AND "), args
}

// CountDead counts the dead jobs f matches.
func (s *Store) CountDead(ctx context.Context, f DeadFilter) (int, error) {
	where, args := f.where()
	var n int
	err := s.pool.QueryRow(ctx, `SELECT count(*) FROM keel_jobs WHERE `+where, args...).Scan(&n)
	return n, interpretError(err)
}

// ListDead returns up to limit dead jobs f matches, newest death first,
// skipping offset of them.
func (s *Store) ListDead(ctx context.Context, f DeadFilter, limit, offset int) ([]Job, error) {
	where, args := f.where()
	if limit <= 0 || limit > 1000 {
		limit = 100
	}
	args = append(args, limit, max(offset, 0))
	rows, err := s.pool.Query(ctx, fmt.Sprintf(`SELECT `+jobColumns+` FROM keel_jobs WHERE %s
		ORDER BY finished_at DESC, id LIMIT $%d OFFSET $%d`, where, len(args)-1, len(args)), args...)
	if err != nil {
		return nil, interpretError(err)
	}
	jobs, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Job, error) { return scanJob(r) })
	return jobs, interpretError(err)
}

// DeadIDs returns the ids of every dead job f matches, oldest death first,
// read in one statement: pages read one after another would skip a job
// that left the set meanwhile and repeat one when another joined it.
func (s *Store) DeadIDs(ctx context.Context, f DeadFilter) ([]string, error) {
	where, args := f.where()
	rows, err := s.pool.Query(ctx, `SELECT id FROM keel_jobs WHERE `+where+` ORDER BY finished_at, id`, args...)
	if err != nil {
		return nil, interpretError(err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	return ids, interpretError(err)
}

// BulkResult says what a bulk action did.
type BulkResult struct {
	Matched, Done int
	Failed        map[string]string // job id → why it was skipped
}

// ReplayMatching replays every dead job f matches. expect is the count the
// person confirmed; when the set has changed since, nothing is done and
// ErrCountChanged is returned, so a confirmation always means what it said.
func (s *Store) ReplayMatching(ctx context.Context, insp *asynq.Inspector, f DeadFilter, expect int, actor, note string) (BulkResult, error) {
	return s.bulk(ctx, f, expect, actor, func(id string) error {
		_, err := s.Replay(ctx, insp, id, actor, note)
		return err
	})
}

// DiscardMatching discards every dead job f matches; see ReplayMatching.
func (s *Store) DiscardMatching(ctx context.Context, insp *asynq.Inspector, f DeadFilter, expect int, actor, note string) (BulkResult, error) {
	if strings.TrimSpace(note) == "" {
		return BulkResult{}, ErrNoteRequired
	}
	return s.bulk(ctx, f, expect, actor, func(id string) error {
		_, err := s.Discard(ctx, insp, id, actor, note)
		return err
	})
}

func (s *Store) bulk(ctx context.Context, f DeadFilter, expect int, actor string, each func(id string) error) (BulkResult, error) {
	if strings.TrimSpace(actor) == "" {
		return BulkResult{}, ErrActorRequired
	}
	ids, err := s.DeadIDs(ctx, f)
	if err != nil {
		return BulkResult{}, err
	}
	res := BulkResult{Matched: len(ids), Failed: map[string]string{}}
	if len(ids) != expect {
		return res, fmt.Errorf("%w: confirmed %d, now %d", ErrCountChanged, expect, len(ids))
	}
	for _, id := range ids {
		if err := each(id); err != nil {
			res.Failed[id] = err.Error()
			continue
		}
		res.Done++
	}
	return res, nil
}
