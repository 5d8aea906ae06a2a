package ledger

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
)

// The statements of keel's reports: `keel ledger`, the metrics collector
// and the CLI's hints. They use the ledger's partial indexes (status =
// 'dead'; published_at IS NULL; open batches) and small tables, so a
// scrape costs little however large the ledger.

const ledgerSizeSQL = `SELECT pg_total_relation_size('keel_jobs') + pg_total_relation_size('keel_steps')`

// LedgerSize returns the bytes the jobs and their steps take, with their
// indexes and TOAST.
func LedgerSize(ctx context.Context, db DB) (int64, error) {
	var n int64
	err := db.QueryRow(ctx, ledgerSizeSQL).Scan(&n)
	return n, err
}

const jobsByStatusSQL = `SELECT status, count(*) FROM keel_jobs GROUP BY status`

// JobsByStatus counts the jobs of each status that has any.
func JobsByStatus(ctx context.Context, db DB) (map[string]int64, error) {
	rows, err := db.Query(ctx, jobsByStatusSQL)
	if err != nil {
		return nil, err
	}
	out := map[string]int64{}
	var status string
	var n int64
	_, err = pgx.ForEachRow(rows, []any{&status, &n}, func() error { out[status] = n; return nil })
	return out, err
}

// Prunable counts the jobs a prune with retention and notice
// (outbox.ReconcilerConfig's Retention and DeadDropNotice) would delete
// now: it follows the same PlanPrune, and counts by the same predicates
// as PruneKind and DropDeadLetters delete by. Retention 0 or less turns
// pruning off: none.
func Prunable(ctx context.Context, db DB, retention, notice time.Duration, now Now) (int64, error) {
	if retention <= 0 {
		return 0, nil
	}
	plan, err := PlanPrune(ctx, db, retention)
	if err != nil {
		return 0, err
	}
	var total int64
	for _, k := range plan.Finished {
		n, err := CountPastKeep(ctx, db, k.Kind, k.Status, k.Keep, now)
		if err != nil {
			return total, err
		}
		total += n
	}
	for _, b := range plan.Dead {
		n, err := CountDroppable(ctx, db, b, notice, now)
		if err != nil {
			return total, err
		}
		total += n
	}
	return total, nil
}

// prunedSQL: older rows go only after a prune that removed something.
const prunedSQL = `SELECT coalesce(sum(rows) FILTER (WHERE at > coalesce($1::timestamptz, now()) - interval '1 day'), 0),
				coalesce(sum(rows), 0) FROM keel_prune_log WHERE at > coalesce($1::timestamptz, now()) - interval '7 days'`

// Pruned returns how many jobs were pruned in the last day and in the last
// 7 days.
func Pruned(ctx context.Context, db DB, now Now) (day, week int64, err error) {
	err = db.QueryRow(ctx, prunedSQL, now).Scan(&day, &week)
	return day, week, err
}

// DeadCount is the number of dead letters of one queue, kind and error
// class.
type DeadCount struct {
	Queue, Kind, Class string
	N                  int64
}

const deadLettersSQL = `SELECT queue, kind, coalesce(error_class, ''), count(*)
		FROM keel_jobs WHERE status = 'dead' GROUP BY 1, 2, 3 ORDER BY 1, 2, 3`

// DeadLetters counts the dead letters by queue, kind and error class, in
// that order.
func DeadLetters(ctx context.Context, db DB) ([]DeadCount, error) {
	rows, err := db.Query(ctx, deadLettersSQL)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowToStructByPos[DeadCount])
}

const openBatchesSQL = `SELECT count(*) FILTER (WHERE sealed_at IS NULL), count(*) FILTER (WHERE sealed_at IS NOT NULL)
		FROM keel_batches WHERE completed_at IS NULL`

// OpenBatches counts the batches not yet complete: those still open to
// new members, and those sealed.
func OpenBatches(ctx context.Context, db DB) (open, sealed int64, err error) {
	err = db.QueryRow(ctx, openBatchesSQL).Scan(&open, &sealed)
	return open, sealed, err
}

// WaitingCount is the jobs of one kind waiting for their parents.
type WaitingCount struct {
	Kind string
	N    int64
	// OnDead counts those with a dead parent: they wait for a person (a
	// replay of the parent, or a release or cancel of the job).
	OnDead int64
	// Oldest is when the oldest of them was enqueued.
	Oldest time.Time
}

const waitingByKindSQL = `SELECT j.kind, count(*),
		count(*) FILTER (WHERE EXISTS (SELECT 1 FROM keel_job_deps d JOIN keel_jobs p ON p.id = d.parent_id
			WHERE d.child_id = j.id AND d.met_at IS NULL AND p.status = 'dead')),
		min(j.created_at)
	FROM keel_jobs j WHERE j.status = 'waiting' AND j.key_held_since IS NULL GROUP BY j.kind ORDER BY j.kind`

// WaitingByKind counts the jobs waiting for their parents, by kind (not
// those held for a concurrency slot: HeldByKind).
func WaitingByKind(ctx context.Context, db DB) ([]WaitingCount, error) {
	rows, err := db.Query(ctx, waitingByKindSQL)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowToStructByPos[WaitingCount])
}

const newestKeyOfKindSQL = `SELECT business_key FROM keel_jobs WHERE kind = $1 ORDER BY id DESC LIMIT 1`

// NewestKeyOfKind returns the business key of the newest job of kind,
// pgx.ErrNoRows when the ledger has none.
func NewestKeyOfKind(ctx context.Context, db DB, kind string) (string, error) {
	var key string
	err := db.QueryRow(ctx, newestKeyOfKindSQL, kind).Scan(&key)
	return key, err
}

const kindsSQL = `SELECT DISTINCT kind FROM keel_jobs ORDER BY kind LIMIT 20`

// Kinds returns the first 20 kinds, in order, the ledger holds jobs of.
func Kinds(ctx context.Context, db DB) ([]string, error) {
	rows, err := db.Query(ctx, kindsSQL)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}
