package inspect

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/ledger"
)

// Filter selects jobs for a bulk action, a dry run or a list. Zero fields
// match everything.
type Filter struct {
	// Open selects the jobs not finished, every one a cancel applies to
	// (pending, running, failed, waiting for parents or a concurrency
	// slot, paused by their kind), with Since and Until on when they were
	// enqueued; otherwise dead jobs, with Since and Until on when they
	// died. ReplayMatching and DiscardMatching read dead jobs and
	// CancelMatching open ones, whatever Open says.
	Open               bool
	Kind, Queue, Class string // Class is the error class
	Since, Until       time.Time
}

func (f Filter) ledger() ledger.Filter {
	return ledger.Filter{Open: f.Open, Kind: f.Kind, Queue: f.Queue, Class: f.Class, Since: f.Since, Until: f.Until}
}

// forAction is f over the jobs a applies to.
func (f Filter) forAction(a Action) Filter {
	f.Open = a == ActionCancel
	return f
}

// Count counts the jobs f matches.
func (in *Inspector) Count(ctx context.Context, f Filter) (int, error) {
	n, err := ledger.CountMatching(ctx, in.pool, f.ledger())
	return n, interpret(err)
}

// List returns up to limit (at most 1000; 100 when not positive) of the
// jobs f matches, most recent first (death, or enqueueing), skipping
// offset of them.
func (in *Inspector) List(ctx context.Context, f Filter, limit, offset int) ([]idempotency.Job, error) {
	if limit <= 0 || limit > 1000 {
		limit = 100
	}
	ids, err := ledger.ListMatching(ctx, in.pool, f.ledger(), limit, offset)
	if err != nil {
		return nil, interpret(err)
	}
	return in.jobs(ctx, ids)
}

// jobs reads the jobs ids, in that order (those gone meanwhile left out).
func (in *Inspector) jobs(ctx context.Context, ids []string) ([]idempotency.Job, error) {
	js, err := in.store.GetMany(ctx, in.pool, ids)
	if err != nil {
		return nil, err
	}
	at := make(map[string]int, len(ids))
	for i, id := range ids {
		at[id] = i
	}
	slices.SortFunc(js, func(a, b idempotency.Job) int { return at[a.ID] - at[b.ID] })
	return js, nil
}

// IDs returns the ids of every job f matches, oldest first, read in one
// statement: pages read one after another would skip a job that left the
// set meanwhile and repeat one when another joined it.
func (in *Inspector) IDs(ctx context.Context, f Filter) ([]string, error) {
	ids, err := ledger.MatchingIDs(ctx, in.pool, f.ledger())
	return ids, interpret(err)
}

// BulkResult says what a bulk action did.
type BulkResult struct {
	// Matched is how many jobs the action was given; Done how many it
	// changed.
	Matched, Done int
	// Unchanged are the jobs it had nothing to do to, and why (replayed,
	// discarded or cancelled already).
	Unchanged map[string]string
	// Failed are the jobs it refused or failed on, and why.
	Failed map[string]error
}

// Bulk does action a to the jobs ids, as actor with note (required for a
// discard), each as the single action would: the same refusals, and the
// same audit row. The ledger work is set-based, a transaction per page of
// jobs; progress, if not nil, is called after each page with the result
// so far (a copy, the caller's to keep). A page that fails as a whole (the ledger unreachable) has each
// of its jobs in Failed, and the next page is tried. A ctx that ends stops
// it between pages: the jobs not reached are in Failed, with ctx's error,
// which Bulk returns too. A cancel of more than a page first reads the
// order to take them in (ledger.CancelOrder); when that read fails, every
// job is in Failed and Bulk returns its error.
func (in *Inspector) Bulk(ctx context.Context, a Action, ids []string, actor, note string, progress func(BulkResult)) (BulkResult, error) {
	if err := needActor(actor); err != nil {
		return BulkResult{}, err
	}
	if err := needNote(a, note); err != nil {
		return BulkResult{}, err
	}
	ids = distinct(ids)
	res := BulkResult{Matched: len(ids), Unchanged: map[string]string{}, Failed: map[string]error{}}
	if a == ActionCancel && len(ids) > pageSize {
		ordered, err := ledger.CancelOrder(ctx, in.pool, ids)
		if err != nil {
			for _, id := range ids {
				res.Failed[id] = interpret(err)
			}
			return res, interpret(err)
		}
		// Ids of no job go last, for their pages to say so.
		ids = append(ordered, missing(ids, ordered)...)
	}
	graceUntil := time.Now().Add(activeGrace)
	for start := 0; start < len(ids); start += pageSize {
		if err := ctx.Err(); err != nil {
			for _, id := range ids[start:] {
				res.Failed[id] = err
			}
			return res, err
		}
		page := ids[start:min(start+pageSize, len(ids))]
		os, err := in.actPage(ctx, a, page, actor, note, graceUntil)
		if err != nil {
			for _, id := range page {
				res.Failed[id] = err
			}
		}
		for _, o := range os {
			switch {
			case o.err != nil:
				res.Failed[o.id] = o.err
			case o.unchanged != "":
				res.Unchanged[o.id] = o.unchanged
			case o.acted:
				res.Done++
			default:
				// Judged so, then changed by no statement: cannot be
				// while its row is locked; said rather than counted.
				res.Failed[o.id] = errChanged
			}
		}
		if progress != nil {
			progress(res.clone())
		}
	}
	return res, nil
}

// clone is r with maps of its own: a progress report stays as it was
// while the action goes on.
func (r BulkResult) clone() BulkResult {
	r.Unchanged, r.Failed = maps.Clone(r.Unchanged), maps.Clone(r.Failed)
	return r
}

var errChanged = errors.New("keel: the job changed while it was acted on")

func distinct(ids []string) []string {
	seen := make(map[string]bool, len(ids))
	out := make([]string, 0, len(ids))
	for _, id := range ids {
		if !seen[id] {
			seen[id] = true
			out = append(out, id)
		}
	}
	return out
}

// ReplayMatching replays every dead job f matches. expect is the count the
// person confirmed; when the set has changed since, nothing is done and
// ErrCountChanged is returned, so a confirmation always means what it
// said. See Bulk.
func (in *Inspector) ReplayMatching(ctx context.Context, f Filter, expect int, actor, note string) (BulkResult, error) {
	return in.matching(ctx, ActionReplay, f, expect, actor, note)
}

// DiscardMatching discards every dead job f matches; see ReplayMatching.
func (in *Inspector) DiscardMatching(ctx context.Context, f Filter, expect int, actor, note string) (BulkResult, error) {
	return in.matching(ctx, ActionDiscard, f, expect, actor, note)
}

// CancelMatching cancels every job not finished that f matches (those
// held by their kind's pause or for a concurrency slot too); see
// ReplayMatching. A job held for a slot frees none; one its kind's pause
// held frees its own for the next held job of its key.
func (in *Inspector) CancelMatching(ctx context.Context, f Filter, expect int, actor, note string) (BulkResult, error) {
	return in.matching(ctx, ActionCancel, f, expect, actor, note)
}

func (in *Inspector) matching(ctx context.Context, a Action, f Filter, expect int, actor, note string) (BulkResult, error) {
	if err := needActor(actor); err != nil {
		return BulkResult{}, err
	}
	if err := needNote(a, note); err != nil {
		return BulkResult{}, err
	}
	ids, err := in.IDs(ctx, f.forAction(a))
	if err != nil {
		return BulkResult{}, err
	}
	if len(ids) != expect {
		return BulkResult{Matched: len(ids)}, fmt.Errorf("%w: confirmed %d, now %d", ErrCountChanged, expect, len(ids))
	}
	return in.Bulk(ctx, a, ids, actor, note, nil)
}

// Outcome is what an action would do to one job (Check).
type Outcome struct {
	ID string
	// Unchanged, when not empty, says why the action has nothing to do.
	Unchanged string
	// Err is why the action refuses the job (or ErrNotFound).
	Err error
}

// Would reports whether the action would change the job.
func (o Outcome) Would() bool { return o.Err == nil && o.Unchanged == "" }

// Check is what action a would do to each of the jobs ids now, changing
// nothing: a dry run, by the rules the action applies. Only a replay's
// check of Redis (ErrTaskActive) is left to the action.
func (in *Inspector) Check(ctx context.Context, a Action, ids []string) ([]Outcome, error) {
	os, err := judge(ctx, in.pool, a, ids)
	if err != nil {
		return nil, err
	}
	out := make([]Outcome, len(os))
	for i, o := range os {
		out[i] = Outcome{ID: o.id, Unchanged: o.unchanged, Err: o.err}
	}
	return out, nil
}

// DryRun is what a bulk action by filter would do (DryRunMatching).
type DryRun struct {
	// Matched is how many jobs the filter selects for the action; Would
	// how many it would change, Unchanged how many it has nothing to do to.
	Matched, Would, Unchanged int
	// Refused counts the jobs it would refuse by why: "superseded",
	// "effects committed", "steps in doubt", "status".
	Refused map[string]int
}

// RefusedTotal is how many jobs the action would refuse.
func (d DryRun) RefusedTotal() int {
	n := 0
	for _, c := range d.Refused {
		n += c
	}
	return n
}

// DryRunMatching counts what action a would do to the jobs f matches
// (dead ones, or for a cancel those not finished), changing nothing, by
// the rules the action applies, in one statement.
func (in *Inspector) DryRunMatching(ctx context.Context, a Action, f Filter) (DryRun, error) {
	vs, err := ledger.CountVerdicts(ctx, in.pool, a, f.forAction(a).ledger())
	if err != nil {
		return DryRun{}, interpret(err)
	}
	d := DryRun{Refused: map[string]int{}}
	for v, n := range vs {
		d.Matched += n
		switch v {
		case ledger.VerdictOK:
			d.Would += n
		case ledger.VerdictAlready:
			d.Unchanged += n
		default:
			d.Refused[refusalName[v]] += n
		}
	}
	return d, nil
}

var refusalName = map[string]string{
	ledger.VerdictSuperseded: "superseded",
	ledger.VerdictEffects:    "effects committed",
	ledger.VerdictDoubt:      "steps in doubt",
	ledger.VerdictStatus:     "status",
	ledger.VerdictDead:       "status",
}

// Count is how many jobs of a kind are in a status.
type Count struct {
	Kind   string
	Status idempotency.Status
	N      int
}

// Counts counts the jobs of each of kinds by status (of every kind when
// none is named: that reads the whole ledger). A status no job of a kind
// is in is left out.
func (in *Inspector) Counts(ctx context.Context, kinds ...string) ([]Count, error) {
	cs, err := ledger.Counts(ctx, in.pool, kinds)
	if err != nil {
		return nil, interpret(err)
	}
	out := make([]Count, len(cs))
	for i, c := range cs {
		out[i] = Count{Kind: c.Kind, Status: idempotency.Status(c.Status), N: c.N}
	}
	return out, nil
}

// ended reports whether a job in status st has run its course: it
// succeeded, or is dead, discarded or cancelled.
func ended(st idempotency.Status) bool {
	return st.Terminal() || st == idempotency.StatusDead
}

// WaitDone waits until the job id has ended (succeeded, dead, discarded or
// cancelled) and returns it, reading the ledger every Config.Poll, or
// until ctx ends.
func (in *Inspector) WaitDone(ctx context.Context, id string) (idempotency.Job, error) {
	t := time.NewTicker(in.poll)
	defer t.Stop()
	for {
		st, err := ledger.JobStatus(ctx, in.pool, id)
		if err != nil {
			return idempotency.Job{}, interpret(err)
		}
		if ended(idempotency.Status(st)) {
			return in.store.Get(ctx, id)
		}
		select {
		case <-ctx.Done():
			return idempotency.Job{}, fmt.Errorf("keel: waiting for job %s (%s): %w", id, st, ctx.Err())
		case <-t.C:
		}
	}
}

// ResolveStep records a person's verdict on a step of a dead job in doubt:
// happened = true marks it done (a replay skips it), false forgets the
// start (a replay calls it again, with the same idempotency key), refused
// with ErrCallInFlight while the call may still be in flight. Saying the
// same twice is a no-op.
func (in *Inspector) ResolveStep(ctx context.Context, jobID, step string, happened bool, actor, note string) error {
	if err := needActor(actor); err != nil {
		return err
	}
	tx, err := in.pool.Begin(ctx)
	if err != nil {
		return interpret(err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck
	// Only a dead job's steps: a running job's step may be in flight, and
	// forgetting its start would let the call happen twice.
	st, err := ledger.LockStatus(ctx, tx, jobID)
	if isNoRows(err) {
		return fmt.Errorf("%w: no job with id %s", ErrNotFound, jobID)
	}
	if err != nil {
		return interpret(err)
	}
	if idempotency.Status(st) != idempotency.StatusDead {
		return fmt.Errorf("%w: job %s is %s; steps are resolved on dead jobs only", ErrNotDead, jobID, st)
	}
	action := "step-not-happened"
	if happened {
		action = "step-happened"
	}
	settled, err := ledger.SettleStep(ctx, tx, jobID, step, happened, nil)
	if err != nil {
		return interpret(err)
	}
	if !settled && !happened {
		inFlight, err := ledger.StepInFlight(ctx, tx, jobID, step, nil)
		if err != nil && !isNoRows(err) {
			return interpret(err)
		}
		if inFlight {
			return fmt.Errorf("%w: step %q of job %s: a worker that gave its run up still waits for the call to return; "+
				"say whether it happened once it has (the job's page shows until when the call may be in flight), or say it happened", ErrCallInFlight, step, jobID)
		}
	}
	if !settled {
		cur, err := ledger.StepStatus(ctx, tx, jobID, step)
		switch {
		case err == nil && cur == "done" && happened:
			return nil // already so: said twice, or it finished
		case err == nil && cur == "done":
			return fmt.Errorf("%w: step %q of job %s is done, not in doubt (said to have happened, or it finished)", ErrNotFound, step, jobID)
		case isNoRows(err) && !happened:
			// Said not to have happened before, and nothing ran since:
			// said twice, as for happened above.
			said, err := ledger.Audited(ctx, tx, jobID, "step-not-happened:"+step)
			if err != nil {
				return interpret(err)
			}
			if said {
				return nil
			}
			return fmt.Errorf("%w: no step %q recorded for job %s (never started)", ErrNotFound, step, jobID)
		case err == nil || isNoRows(err):
			return fmt.Errorf("%w: no step %q recorded for job %s (never started, or forgotten already)", ErrNotFound, step, jobID)
		}
		return interpret(err)
	}
	if err := ledger.Audit(ctx, tx, jobID, action+":"+step, actor, note, nil); err != nil {
		return interpret(err)
	}
	return interpret(tx.Commit(ctx))
}

func isNoRows(err error) bool { return errors.Is(err, pgx.ErrNoRows) }

// missing returns the ids of all that are not in some, in all's order.
func missing(all, some []string) []string {
	in := make(map[string]bool, len(some))
	for _, id := range some {
		in[id] = true
	}
	var out []string
	for _, id := range all {
		if !in[id] {
			out = append(out, id)
		}
	}
	return out
}
