package ledger

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

// Retention per kind and status (keel_retention, migration 0028), the
// prune that follows it, and the dead letters' bounds.

// Sources of a retention policy: a person's wins over a kind's code.
const (
	SourcePerson = "person"
	SourceCode   = "code"
)

// Policy is one kind's retention for one status.
type Policy struct {
	Kind, Status, Source string
	// Keep is how long a job is kept after it finished; 0 is for ever.
	Keep time.Duration
	// MaxCount bounds a kind's dead letters; 0 is no bound.
	MaxCount int64
	SetBy    string
	SetAt    time.Time
	Note     string
}

// setRetentionSQL records a person's policy and audits it in one
// statement. The audit's action names the kind, the status and the
// policy, so `keel_audit` alone says what was in force when.
const setRetentionSQL = `WITH p AS (INSERT INTO keel_retention (kind, status, source, keep_ms, max_count, set_by, set_at, note)
	VALUES ($1, $2, 'person', nullif($3::bigint, 0), nullif($4::bigint, 0), $5, coalesce($7::timestamptz, now()), $6)
	ON CONFLICT (kind, status, source) DO UPDATE SET keep_ms = EXCLUDED.keep_ms, max_count = EXCLUDED.max_count,
		set_by = EXCLUDED.set_by, set_at = EXCLUDED.set_at, note = EXCLUDED.note
	RETURNING kind, status, keep_ms, max_count)
INSERT INTO keel_audit (job_id, action, actor, note, at)
SELECT '', 'retention-set:' || kind || '/' || status || ' keep_ms=' || coalesce(keep_ms::text, 'forever') ||
	' max_count=' || coalesce(max_count::text, 'none'), $5, $6, coalesce($7::timestamptz, now()) FROM p`

// SetRetention records p as a person's policy (replacing theirs for the
// kind and status), by actor with note, audited.
func SetRetention(ctx context.Context, db DB, p Policy, actor, note string, now Now) error {
	_, err := db.Exec(ctx, setRetentionSQL, p.Kind, p.Status, p.Keep.Milliseconds(), p.MaxCount, actor, note, now)
	return err
}

const unsetRetentionSQL = `WITH r AS (DELETE FROM keel_retention WHERE kind = $1 AND status = $2 AND source = 'person' RETURNING kind, status)
INSERT INTO keel_audit (job_id, action, actor, note, at)
SELECT '', 'retention-unset:' || kind || '/' || status, $3, $4, coalesce($5::timestamptz, now()) FROM r`

// UnsetRetention deletes a person's policy for kind and status, audited,
// and reports whether there was one.
func UnsetRetention(ctx context.Context, db DB, kind, status, actor, note string, now Now) (bool, error) {
	tag, err := db.Exec(ctx, unsetRetentionSQL, kind, status, actor, note, now)
	return tag.RowsAffected() == 1, err
}

// declareRetentionSQL makes a kind's code policies those of $2..: the
// rows it no longer declares go, the others are written as declared.
const declareRetentionSQL = `WITH d AS (SELECT * FROM unnest($2::text[], $3::bigint[], $4::bigint[]) AS d (status, keep_ms, max_count)),
gone AS (DELETE FROM keel_retention r WHERE r.kind = $1 AND r.source = 'code' AND r.status <> ALL ($2::text[]))
INSERT INTO keel_retention (kind, status, source, keep_ms, max_count, set_by, note)
SELECT $1, status, 'code', nullif(keep_ms, 0), nullif(max_count, 0), $5, '' FROM d
ON CONFLICT (kind, status, source) DO UPDATE SET keep_ms = EXCLUDED.keep_ms, max_count = EXCLUDED.max_count,
	set_by = EXCLUDED.set_by, set_at = now()
WHERE (keel_retention.keep_ms, keel_retention.max_count) IS DISTINCT FROM (EXCLUDED.keep_ms, EXCLUDED.max_count)`

// DeclareRetention records ps as kind's policies declared in code (a
// worker's tasks.Keep options), by, replacing those it declared before.
func DeclareRetention(ctx context.Context, db DB, kind string, ps []Policy, by string) error {
	statuses := make([]string, len(ps))
	keeps := make([]int64, len(ps))
	counts := make([]int64, len(ps))
	for i, p := range ps {
		statuses[i], keeps[i], counts[i] = p.Status, p.Keep.Milliseconds(), p.MaxCount
	}
	_, err := db.Exec(ctx, declareRetentionSQL, kind, statuses, keeps, counts, by)
	return err
}

const retentionSQL = `SELECT kind, status, source, coalesce(keep_ms, 0) * interval '1 millisecond', coalesce(max_count, 0),
	set_by, set_at, note FROM keel_retention ORDER BY kind, status, source DESC`

// Retention returns every policy, by kind and status, a person's before
// the code's.
func Retention(ctx context.Context, db DB) ([]Policy, error) {
	rows, err := db.Query(ctx, retentionSQL)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowToStructByPos[Policy])
}

// finishedKindsSQL lists the kinds that have finished jobs by skipping
// through keel_jobs_finished_kind one kind at a time: as many index probes
// as there are kinds, however many jobs each has.
const finishedKindsSQL = `WITH RECURSIVE k (kind) AS (
	(SELECT kind FROM keel_jobs WHERE status IN ('succeeded', 'discarded', 'cancelled') ORDER BY kind LIMIT 1)
	UNION ALL
	SELECT (SELECT j.kind FROM keel_jobs j WHERE j.status IN ('succeeded', 'discarded', 'cancelled') AND j.kind > k.kind
		ORDER BY j.kind LIMIT 1) FROM k WHERE k.kind IS NOT NULL)
SELECT kind FROM k WHERE kind IS NOT NULL`

// FinishedKinds returns the kinds that have succeeded, discarded or
// cancelled jobs, by name.
func FinishedKinds(ctx context.Context, db DB) ([]string, error) {
	rows, err := db.Query(ctx, finishedKindsSQL)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

// FinishedStatuses are the statuses pruned at their kind's retention.
var FinishedStatuses = []string{"succeeded", "discarded", "cancelled"}

// KeepFor is how long kind's jobs of status (one of FinishedStatuses) are
// kept: the policy in force among ps (as Retention returns them), else
// retention; 0 or less is for ever. The prune and Prunable both ask it.
func KeepFor(ps []Policy, kind, status string, retention time.Duration) time.Duration {
	if p, ok := InForce(ps, kind, status); ok {
		return p.Keep
	}
	return retention
}

// KindKeep is one kind's finished jobs of one status and how long they
// are kept (more than 0).
type KindKeep struct {
	Kind, Status string
	Keep         time.Duration
}

// PrunePlan is what a prune goes through, in order: each kind's finished
// jobs kept for a time, and each kind's dead-letter bounds.
type PrunePlan struct {
	Finished []KindKeep
	Dead     []DeadBound
}

// PlanPrune reads the policies and the kinds with finished jobs, and
// returns the prune they make with retention for what no policy names.
// The prune and Prunable both follow it, so that what one counts is what
// the other deletes.
func PlanPrune(ctx context.Context, db DB, retention time.Duration) (PrunePlan, error) {
	ps, err := Retention(ctx, db)
	if err != nil {
		return PrunePlan{}, err
	}
	kinds, err := FinishedKinds(ctx, db)
	if err != nil {
		return PrunePlan{}, err
	}
	var plan PrunePlan
	for _, kind := range kinds {
		for _, status := range FinishedStatuses {
			if keep := KeepFor(ps, kind, status, retention); keep > 0 {
				plan.Finished = append(plan.Finished, KindKeep{Kind: kind, Status: status, Keep: keep})
			}
		}
	}
	plan.Dead = DeadBounds(ps)
	return plan, nil
}

// pastKeepSQL is the finished jobs a prune deletes: kind $1's of status $2
// finished longer than $3 ms before $4, but for one whose given-up handler
// may still run (stray_until ahead), which a new job of its key waits for
// by its row. PruneKind deletes them and CountPastKeep counts them, by this
// one text.
const pastKeepSQL = `kind = $1 AND status = $2 AND status IN ('succeeded', 'discarded', 'cancelled')
	  AND finished_at < coalesce($4::timestamptz, now()) - $3 * interval '1 millisecond' AND ` + noStraySQL

// pruneKindSQL stays on keel_jobs_finished_kind: one kind's range of one
// status, oldest first, whatever other kinds keep. ANY(ARRAY(…)) makes the
// delete probe the primary key per row; with IN (subquery) the planner
// hashes the batch and scans the whole table. A job's steps go by their
// foreign key; its progress and result, which have none, are deleted by the
// same statement: a probe of each table's primary key per job pruned. Its
// dependencies (as a child) go with it too; those naming it as a parent
// stay while their child does, which shows the parent as pruned.
const pruneKindSQL = `WITH gone AS (DELETE FROM keel_jobs WHERE id = ANY (ARRAY (
	SELECT id FROM keel_jobs WHERE ` + pastKeepSQL + `
	ORDER BY finished_at LIMIT $5 FOR UPDATE SKIP LOCKED))
	RETURNING id),
progress AS (DELETE FROM keel_job_progress WHERE job_id = ANY (ARRAY (SELECT id FROM gone))),
results AS (DELETE FROM keel_job_results WHERE job_id = ANY (ARRAY (SELECT id FROM gone))),
deps AS (DELETE FROM keel_job_deps WHERE child_id = ANY (ARRAY (SELECT id FROM gone)))
SELECT count(*) FROM gone`

// PruneKind deletes up to limit of kind's jobs of status (succeeded,
// discarded or cancelled; their steps, progress and result go with them)
// finished longer than keep ago, oldest first, and returns how many.
func PruneKind(ctx context.Context, db DB, kind, status string, keep time.Duration, limit int, now Now) (int, error) {
	var n int
	err := db.QueryRow(ctx, pruneKindSQL, kind, status, keep.Milliseconds(), now, limit).Scan(&n)
	return n, err
}

const countPastKeepSQL = `SELECT count(*) FROM keel_jobs WHERE ` + pastKeepSQL

// CountPastKeep counts what PruneKind would delete with no limit.
func CountPastKeep(ctx context.Context, db DB, kind, status string, keep time.Duration, now Now) (int64, error) {
	var n int64
	err := db.QueryRow(ctx, countPastKeepSQL, kind, status, keep.Milliseconds(), now).Scan(&n)
	return n, err
}

// overBoundSQL is the CTE of kind $1's dead letters past its bounds that
// may go: seen since they died, and either older than the age bound $2
// (ms; 0: none) or among the oldest seen beyond the count bound $3 (0:
// none). Unseen ones are never among them, though they count toward the
// bound; nor are those a job still waits for (a child would wait for ever
// on a parent no one can replay) and those whose given-up handler may
// still run (see pastKeepSQL) (keepsDeadSQL). Both reads are ranges of
// keel_jobs_dead_kind.
const overBoundSQL = `over AS (
	SELECT id FROM keel_jobs WHERE kind = $1 AND status = 'dead' AND seen_at >= finished_at AND $2::bigint > 0
	  AND finished_at < coalesce($4::timestamptz, now()) - $2 * interval '1 millisecond' AND ` + keepsDeadSQL + `
	UNION
	(SELECT id FROM keel_jobs WHERE kind = $1 AND status = 'dead' AND seen_at >= finished_at AND ` + keepsDeadSQL + `
	 ORDER BY finished_at
	 LIMIT greatest((SELECT count(*) FROM keel_jobs WHERE kind = $1 AND status = 'dead' AND $3::bigint > 0) - $3, 0)))`

// noStraySQL is true for a job no given-up handler of which may still run
// at $4 (stray_until, renewed while one does).
const noStraySQL = `(stray_until IS NULL OR stray_until < coalesce($4::timestamptz, now()))`

// keepsDeadSQL is false for a dead letter a job waits for (a dependency
// not met, its child waiting on parents) or whose given-up handler may
// still run. has_dependents spares the rest the look.
const keepsDeadSQL = noStraySQL + ` AND NOT (has_dependents AND EXISTS (SELECT 1 FROM keel_job_deps d JOIN keel_jobs c ON c.id = d.child_id
	      WHERE d.parent_id = keel_jobs.id AND d.met_at IS NULL AND c.status = 'waiting' AND c.waiting_on > 0))`

// DeadBound is a kind's dead-letter bounds as a policy in force sets
// them: an age (Keep, 0: none) and a count (MaxCount, 0: none). Since is
// when the policy was set: a notice older than the policy in force (given
// under an earlier one, unset since) does not count, so no dead letter goes
// without an alert under the policy that drops it.
type DeadBound struct {
	Kind     string
	Keep     time.Duration
	MaxCount int64
	Since    time.Time
}

// DeadBounds returns the dead-letter bounds in force among ps (as
// Retention returns them), one per kind that has any, by kind.
func DeadBounds(ps []Policy) []DeadBound {
	var out []DeadBound
	done := map[string]bool{}
	for _, p := range ps {
		if p.Status != "dead" || done[p.Kind] {
			continue
		}
		done[p.Kind] = true
		p, _ = InForce(ps, p.Kind, "dead")
		if p.Keep <= 0 && p.MaxCount <= 0 {
			continue
		}
		out = append(out, DeadBound{Kind: p.Kind, Keep: p.Keep, MaxCount: p.MaxCount, Since: p.SetAt})
	}
	return out
}

// noticeDeadSQL marks the dead letters past the bounds that no pass has
// noticed since they died and the policy was set, so the alert says they
// are to be dropped a notice period before they are.
const noticeDeadSQL = `WITH ` + overBoundSQL + `
UPDATE keel_jobs SET drop_noticed_at = coalesce($4::timestamptz, now()) WHERE id = ANY (ARRAY (
	SELECT id FROM keel_jobs WHERE id IN (SELECT id FROM over)
	  AND (drop_noticed_at IS NULL OR drop_noticed_at < greatest(finished_at, $6)) LIMIT $5 FOR UPDATE SKIP LOCKED))
  AND status = 'dead'`

// NoticeDeadDrops marks up to limit of a kind's seen dead letters past its
// bounds b as to be dropped, and returns how many it marked.
func NoticeDeadDrops(ctx context.Context, db DB, b DeadBound, limit int, now Now) (int, error) {
	tag, err := db.Exec(ctx, noticeDeadSQL, b.Kind, b.Keep.Milliseconds(), b.MaxCount, now, limit, b.Since)
	return int(tag.RowsAffected()), err
}

// droppableSQL is the dead letters among over (overBoundSQL) a drop
// deletes: noticed, under the policy set at $6, at least the notice $5 ms
// before $4, since they last died. DropDeadLetters deletes them and
// CountDroppable counts them, by this one text.
const droppableSQL = `id IN (SELECT id FROM over) AND status = 'dead'
	  AND drop_noticed_at >= greatest(finished_at, $6) AND drop_noticed_at <= coalesce($4::timestamptz, now()) - $5 * interval '1 millisecond'`

// dropDeadSQL deletes the droppable dead letters. It locks them skipping
// those locked, and its DELETE asks again: a replay (which locks the job
// and makes it pending) or a new death is never dropped.
const dropDeadSQL = `WITH ` + overBoundSQL + `,
gone AS (DELETE FROM keel_jobs WHERE id = ANY (ARRAY (
	SELECT id FROM keel_jobs WHERE ` + droppableSQL + `
	ORDER BY finished_at LIMIT $7 FOR UPDATE SKIP LOCKED))
	AND status = 'dead' AND seen_at >= finished_at AND drop_noticed_at >= greatest(finished_at, $6)
	RETURNING id),
progress AS (DELETE FROM keel_job_progress WHERE job_id = ANY (ARRAY (SELECT id FROM gone))),
results AS (DELETE FROM keel_job_results WHERE job_id = ANY (ARRAY (SELECT id FROM gone))),
deps AS (DELETE FROM keel_job_deps WHERE child_id = ANY (ARRAY (SELECT id FROM gone)))
SELECT count(*) FROM gone`

// DropDeadLetters deletes up to limit of a kind's seen dead letters past
// its bounds b whose drop was noticed at least notice ago, oldest first,
// and returns how many.
func DropDeadLetters(ctx context.Context, db DB, b DeadBound, notice time.Duration, limit int, now Now) (int, error) {
	var n int
	err := db.QueryRow(ctx, dropDeadSQL, b.Kind, b.Keep.Milliseconds(), b.MaxCount, now, notice.Milliseconds(), b.Since, limit).Scan(&n)
	return n, err
}

const countDroppableSQL = `WITH ` + overBoundSQL + `
SELECT count(*) FROM keel_jobs WHERE kind = $1 AND ` + droppableSQL

// CountDroppable counts what DropDeadLetters would delete with no limit.
func CountDroppable(ctx context.Context, db DB, b DeadBound, notice time.Duration, now Now) (int64, error) {
	var n int64
	err := db.QueryRow(ctx, countDroppableSQL, b.Kind, b.Keep.Milliseconds(), b.MaxCount, now, notice.Milliseconds(), b.Since).Scan(&n)
	return n, err
}

// deadToDropSQL counts kind's dead letters noticed as to be dropped that
// are still past its bounds.
const deadToDropSQL = `WITH ` + overBoundSQL + `
SELECT count(*) FROM keel_jobs WHERE kind = $1 AND status = 'dead' AND drop_noticed_at >= greatest(finished_at, $5)
  AND id IN (SELECT id FROM over)`

// DeadToDrop counts a kind's dead letters that are to be dropped once
// their notice has run: what the alert keel_dead_letters_to_drop shows.
func DeadToDrop(ctx context.Context, db DB, b DeadBound, now Now) (int, error) {
	var n int
	err := db.QueryRow(ctx, deadToDropSQL, b.Kind, b.Keep.Milliseconds(), b.MaxCount, now, b.Since).Scan(&n)
	return n, err
}

// markSeenSQL records that a person was shown dead letters: the first
// showing since each died counts.
const markSeenSQL = `UPDATE keel_jobs SET seen_at = coalesce($3::timestamptz, now()), seen_by = $2
	WHERE id = ANY ($1) AND status = 'dead' AND (seen_at IS NULL OR seen_at < finished_at)`

// MarkSeen records that by was shown the dead letters among ids, and
// returns how many had not been seen since they died.
func MarkSeen(ctx context.Context, db DB, ids []string, by string, now Now) (int, error) {
	tag, err := db.Exec(ctx, markSeenSQL, ids, by, now)
	return int(tag.RowsAffected()), err
}

// MinKeep is the shortest retention a policy may set. A finished job's row
// is what dedupes its business key: pruned, the key makes a new job, so a
// producer's retried enqueue (or a late duplicate) must find it still there.
const MinKeep = time.Hour

// Statuses a policy may name, in the order they are shown.
var PolicyStatuses = []string{"succeeded", "discarded", "cancelled", "dead"}

// ValidatePolicy reports what in p cannot be recorded.
func ValidatePolicy(p Policy) error {
	if p.Kind == "" {
		return fmt.Errorf("a retention policy needs a kind")
	}
	if !slices.Contains(PolicyStatuses, p.Status) {
		return fmt.Errorf("retention: status %q is not one of %s", p.Status, strings.Join(PolicyStatuses, ", "))
	}
	if p.Keep != 0 && p.Keep < MinKeep {
		return fmt.Errorf("retention: keep %s is shorter than %s, the least that still dedupes a retried enqueue", p.Keep, MinKeep)
	}
	if p.Keep < 0 || p.MaxCount < 0 {
		return fmt.Errorf("retention: keep and max count cannot be negative")
	}
	if p.MaxCount > 0 && p.Status != "dead" {
		return fmt.Errorf("retention: a max count bounds dead letters only, not %s jobs", p.Status)
	}
	return nil
}

// InForce returns the policy in force for kind's jobs of status among ps
// (as Retention returns them): a person's over the code's; false when
// there is neither.
func InForce(ps []Policy, kind, status string) (Policy, bool) {
	var found *Policy
	for i := range ps {
		if ps[i].Kind == kind && ps[i].Status == status && (found == nil || ps[i].Source == SourcePerson) {
			found = &ps[i]
		}
	}
	if found == nil {
		return Policy{}, false
	}
	return *found, true
}
