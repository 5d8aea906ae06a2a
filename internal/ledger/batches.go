package ledger

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
)

// The statements on batches (keel_batches). A batch's counts are kept by
// triggers in its members' transactions (migration 0010), its callbacks
// enqueued by keel_batch_seal and those triggers.

const batchColumns = `id, description, on_complete, on_success, total, succeeded, dead, discarded, cancelled,
	generation, sealed_at, completed_at, coalesce(complete_job_id, ''), coalesce(success_job_id, ''), created_at, updated_at`

// BatchRow is one row of keel_batches; its callbacks as stored (JSON).
type BatchRow struct {
	ID, Description                              string
	OnComplete, OnSuccess                        []byte
	Total, Succeeded, Dead, Discarded, Cancelled int
	Generation                                   int
	SealedAt, CompletedAt                        *time.Time
	CompleteJobID, SuccessJobID                  string
	CreatedAt, UpdatedAt                         time.Time
}

func scanBatch(row pgx.Row) (BatchRow, error) {
	var b BatchRow
	err := row.Scan(&b.ID, &b.Description, &b.OnComplete, &b.OnSuccess, &b.Total, &b.Succeeded, &b.Dead, &b.Discarded,
		&b.Cancelled, &b.Generation, &b.SealedAt, &b.CompletedAt, &b.CompleteJobID, &b.SuccessJobID, &b.CreatedAt, &b.UpdatedAt)
	return b, err
}

const createBatchSQL = `INSERT INTO keel_batches (id, description, on_complete, on_success)
	VALUES ($1, $2, $3, $4) RETURNING ` + batchColumns

// CreateBatch records an open batch.
func CreateBatch(ctx context.Context, db DB, id, description string, onComplete, onSuccess []byte) (BatchRow, error) {
	return scanBatch(db.QueryRow(ctx, createBatchSQL, id, description, onComplete, onSuccess))
}

const sealBatchSQL = `SELECT ` + batchColumns + ` FROM keel_batch_seal($1)`

// SealBatch seals batch id (keel_batch_seal): nothing joins it any more,
// and its callbacks are enqueued once every member has ended.
func SealBatch(ctx context.Context, db DB, id string) (BatchRow, error) {
	return scanBatch(db.QueryRow(ctx, sealBatchSQL, id))
}

const getBatchSQL = `SELECT ` + batchColumns + ` FROM keel_batches WHERE id = $1`

// GetBatch reads batch id; pgx.ErrNoRows if there is none.
func GetBatch(ctx context.Context, db DB, id string) (BatchRow, error) {
	return scanBatch(db.QueryRow(ctx, getBatchSQL, id))
}

const listBatchesSQL = `SELECT ` + batchColumns + ` FROM keel_batches
	WHERE NOT $1 OR completed_at IS NULL ORDER BY created_at DESC, id DESC LIMIT $2`

// ListBatches lists up to limit batches (only open ones if open), newest
// first.
func ListBatches(ctx context.Context, db DB, open bool, limit int) ([]BatchRow, error) {
	rows, err := db.Query(ctx, listBatchesSQL, open, limit)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (BatchRow, error) { return scanBatch(r) })
}

const batchStatusesSQL = `SELECT status, count(*) FROM keel_jobs WHERE batch_id = $1 GROUP BY status`

// BatchStatuses counts batch id's members by status.
func BatchStatuses(ctx context.Context, db DB, id string) (map[Status]int, error) {
	rows, err := db.Query(ctx, batchStatusesSQL, id)
	if err != nil {
		return nil, err
	}
	out := map[Status]int{}
	var st Status
	var n int
	_, err = pgx.ForEachRow(rows, []any{&st, &n}, func() error { out[st] = n; return nil })
	return out, err
}

const openMembersSQL = `SELECT ` + JobColumns + ` FROM keel_jobs
	WHERE batch_id = $1 AND status IN ('waiting', 'pending', 'paused', 'running', 'failed') ORDER BY created_at, id LIMIT $2`

// OpenMembers returns up to limit members of batch id not yet ended,
// oldest first.
func OpenMembers(ctx context.Context, db DB, id string, limit int) ([]Job, error) {
	rows, err := db.Query(ctx, openMembersSQL, id, limit)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (Job, error) { return ScanJob(r) })
}
