package inspect

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/jobstore"
	"github.com/keeljobs/keel/internal/ledger"
)

// pageSize is how many jobs a bulk action changes in one transaction.
const pageSize = 500

// outcome is what an action did, or would do, to one job.
type outcome struct {
	id, queue string
	err       error  // refused, or failed
	unchanged string // nothing to do, and why
	acted     bool
	// For a cancel that acted: the job was running, and what Redis said.
	wasRunning bool
	redisErr   error
	job        idempotency.Job // single actions only
}

// judged is the outcome an action's verdict v gives, before it acts: the
// one place a verdict becomes keel's answer, for every path.
func judged(a Action, v ledger.Verdict) outcome {
	o := outcome{id: v.ID, queue: v.Queue}
	switch v.Verdict {
	case ledger.VerdictOK:
	case ledger.VerdictAlready:
		switch a {
		case ActionReplay:
			o.unchanged = fmt.Sprintf("the job is %s, not dead", v.Status)
		case ActionDiscard:
			o.unchanged = fmt.Sprintf("already discarded by %s: %q", v.ResolvedBy, v.ResolutionNote)
		case ActionRelease:
			o.unchanged = fmt.Sprintf("the job is %s, not waiting", v.Status)
		default:
			o.unchanged = fmt.Sprintf("already cancelled by %s", v.ResolvedBy)
		}
	case ledger.VerdictSuperseded:
		o.err = fmt.Errorf("%w: job %s was superseded by a newer job of key %q (its kind's tasks.Unique window had passed); enqueue anew instead",
			ErrNotDead, v.ID, ledger.OriginalKey(v.BusinessKey, v.ID))
	case ledger.VerdictEffects:
		o.err = fmt.Errorf("%w (job %s)", ErrEffectsCommitted, v.ID)
	case ledger.VerdictDoubt:
		o.err = fmt.Errorf("%w: %s", ErrStepsInDoubt, strings.Join(v.Doubt, ", "))
	case ledger.VerdictDead:
		o.err = fmt.Errorf("%w: job %s is dead (it has ended); discard it to close it", ErrNotCancellable, v.ID)
	default: // ledger.VerdictStatus
		switch a {
		case ActionReplay:
			o.err = fmt.Errorf("%w: job %s was %s", ErrNotDead, v.ID, v.Status)
		case ActionDiscard:
			o.err = &StatusError{Err: ErrNotDead, JobID: v.ID, Status: idempotency.Status(v.Status)}
		case ActionRelease:
			o.err = &StatusError{Err: ErrNotWaiting, JobID: v.ID, Status: idempotency.Status(v.Status)}
		default:
			o.err = &StatusError{Err: ErrNotCancellable, JobID: v.ID, Status: idempotency.Status(v.Status)}
		}
	}
	return o
}

// judge returns a's outcome on each of ids, in their order, as db sees the
// jobs: an unknown id's is ErrNotFound.
func judge(ctx context.Context, db ledger.DB, a Action, ids []string) ([]outcome, error) {
	vs, err := ledger.Judge(ctx, db, a, ids)
	if err != nil {
		return nil, interpret(err)
	}
	byID := make(map[string]ledger.Verdict, len(vs))
	for _, v := range vs {
		byID[v.ID] = v
	}
	out := make([]outcome, len(ids))
	for i, id := range ids {
		v, ok := byID[id]
		if !ok {
			out[i] = outcome{id: id, err: fmt.Errorf("%w: no job with id %s", ErrNotFound, id)}
			continue
		}
		out[i] = judged(a, v)
		if a == ActionCancel && v.Verdict == ledger.VerdictOK {
			out[i].wasRunning = v.Status == string(idempotency.StatusRunning)
		}
	}
	return out, nil
}

// act does a to ids (distinct) in pages, each page's ledger work in one
// transaction: the rows locked in id order, judged, the action's change
// and its audit rows written in one statement for those it applies to.
// Redis is tidied per job: a replay's archived copy before its commit
// (the new publish would otherwise be a silent conflict), a discard's or
// cancel's after.
func (in *Inspector) act(ctx context.Context, a Action, ids []string, actor, note string) ([]outcome, error) {
	out := make([]outcome, 0, len(ids))
	graceUntil := time.Now().Add(activeGrace)
	for start := 0; start < len(ids); start += pageSize {
		page := ids[start:min(start+pageSize, len(ids))]
		os, err := in.actPage(ctx, a, page, actor, note, graceUntil)
		if err != nil {
			return out, err
		}
		out = append(out, os...)
	}
	return out, nil
}

// graceUntil bounds the waits of a whole action for asynq to let go of
// tasks (deleteTask): a replay of many jobs does not wait for each in turn
// while it holds their rows locked.
func (in *Inspector) actPage(ctx context.Context, a Action, ids []string, actor, note string, graceUntil time.Time) ([]outcome, error) {
	if a == ActionReplay && in.insp != nil {
		in.awaitTasksLetGo(ctx, ids, graceUntil)
	}
	var os []outcome
	err := pgx.BeginFunc(ctx, in.pool, func(tx pgx.Tx) error {
		if err := ledger.LockJobs(ctx, tx, ids); err != nil {
			return interpret(err)
		}
		var err error
		if os, err = judge(ctx, tx, a, ids); err != nil {
			return err
		}
		var ok []string
		for i := range os {
			if os[i].err != nil || os[i].unchanged != "" {
				continue
			}
			if a == ActionReplay && in.insp != nil {
				// No waiting here, with the rows locked: awaitTasksLetGo did.
				if os[i].err = deleteTask(ctx, in.insp, os[i].queue, os[i].id, time.Time{}); os[i].err != nil {
					continue
				}
			}
			ok = append(ok, os[i].id)
		}
		if len(ok) == 0 {
			return nil
		}
		acted, err := ledger.Act(ctx, tx, a, ok, actor, note, nil)
		if err != nil {
			return interpret(err)
		}
		done := make(map[string]ledger.Acted, len(acted))
		for _, x := range acted {
			done[x.ID] = x
		}
		for i := range os {
			if x, ok := done[os[i].id]; ok {
				os[i].acted, os[i].wasRunning = true, x.WasRunning
			}
		}
		if a == ActionReplay || a == ActionRelease {
			return jobstore.NotifyRelay(ctx, tx)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	if in.insp == nil || a == ActionReplay || a == ActionRelease {
		return os, nil
	}
	for i := range os {
		if !os[i].acted {
			continue
		}
		if a == ActionDiscard {
			// Best effort: the ledger is the record; asynq's copy is clutter.
			_ = in.insp.DeleteTask(os[i].queue, os[i].id)
		} else {
			os[i].redisErr = stopInRedis(in.insp, os[i].queue, os[i].id, os[i].wasRunning)
		}
	}
	return os, nil
}

// awaitTasksLetGo waits, until graceUntil, for asynq to let go of the
// tasks of those of ids a replay would act on, before their rows are
// locked: a worker that has just recorded a job's death writes its row
// once more (its alert paid) before it gives asynq the task back, so a
// replay that waited holding the row would wait for itself.
func (in *Inspector) awaitTasksLetGo(ctx context.Context, ids []string, graceUntil time.Time) {
	os, err := judge(ctx, in.pool, ActionReplay, ids)
	if err != nil {
		return // the transaction reads them again, and says why
	}
	for _, o := range os {
		if o.err != nil || o.unchanged != "" {
			continue
		}
		for {
			info, err := in.insp.GetTaskInfo(o.queue, o.id)
			if err != nil || info.State != asynq.TaskStateActive || time.Now().After(graceUntil) || ctx.Err() != nil {
				break
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
}

// deleteTask removes asynq's copy of job id, if any. A task asynq holds as
// running cannot be removed: a worker that died running it holds it until
// asynq's lease on it lapses and asynq takes it back. A worker that has
// just recorded the job's death lets go of it within moments, so an active
// task is looked at again until graceUntil (zero: not at all, as in a
// transaction holding the job's row, see awaitTasksLetGo) before the
// replay is refused.
func deleteTask(ctx context.Context, insp *asynq.Inspector, queue, id string, graceUntil time.Time) error {
	for {
		err := insp.DeleteTask(queue, id)
		if err == nil || errors.Is(err, asynq.ErrTaskNotFound) || errors.Is(err, asynq.ErrQueueNotFound) {
			return nil
		}
		info, ierr := insp.GetTaskInfo(queue, id)
		if ierr != nil || info.State != asynq.TaskStateActive {
			return fmt.Errorf("keel: remove the task of job %s from asynq: %w", id, err)
		}
		if time.Now().After(graceUntil) || ctx.Err() != nil {
			return fmt.Errorf("%w (job %s; the worker that ran it may have died, and asynq takes the task back once "+
				"its lease lapses, within about a minute): try again then", ErrTaskActive, id)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// activeGrace is how long a replay (of one job or many, in all) waits for
// asynq to let go of tasks their workers are finishing (awaitTasksLetGo):
// moments on a quiet host, seconds on a busy one.
const activeGrace = 5 * time.Second

// stopInRedis removes a cancelled job's task from asynq, or, when a worker
// has it (running in the ledger, or just dequeued), asks asynq to cancel its
// handler's context. Either may miss (a task in flight between states, a
// lost pub/sub message): the guard's claim and lease renewal see the
// ledger's cancel all the same.
func stopInRedis(insp *asynq.Inspector, queue, id string, running bool) error {
	if !running {
		err := insp.DeleteTask(queue, id)
		if err == nil || errors.Is(err, asynq.ErrTaskNotFound) || errors.Is(err, asynq.ErrQueueNotFound) {
			return nil
		}
		// Most likely active: a worker dequeued it a moment ago.
	}
	if err := insp.CancelProcessing(id); err != nil {
		return fmt.Errorf("keel: cancel the running task %s in asynq: %w", id, err)
	}
	return nil
}
