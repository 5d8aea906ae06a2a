package jobstore

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/keeljobs/keel/internal/ledger"
)

var (
	// ErrBatchSealed means a job was enqueued into a batch that is sealed:
	// its members are all known, nothing joins it any more.
	ErrBatchSealed = errors.New("keel: batch is sealed")
	// ErrBatchNotFound means no batch has the id given.
	ErrBatchNotFound = errors.New("keel: batch not found")
)

// The SQLSTATEs the batch triggers raise (see migration 0010).
const (
	sqlstateBatchSealed   = "KB001"
	sqlstateBatchNotFound = "KB002"
)

func batchError(err error) error {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		return nil
	}
	switch pgErr.Code {
	case sqlstateBatchSealed:
		return fmt.Errorf("%w: %s", ErrBatchSealed, strings.TrimPrefix(pgErr.Message, "keel: "))
	case sqlstateBatchNotFound:
		return fmt.Errorf("%w: %s", ErrBatchNotFound, strings.TrimPrefix(pgErr.Message, "keel: "))
	}
	return nil
}

// BatchCallback is the job a batch enqueues when it completes. Its payload
// is made by keel: the batch's id, generation and counts, with Data (JSON,
// given when the batch was made) inside.
type BatchCallback struct {
	Kind     string          `json:"kind"`
	Queue    string          `json:"queue"`
	MaxRetry int             `json:"max_retry"`
	Timeout  time.Duration   `json:"-"`
	MaxWait  time.Duration   `json:"-"`
	Data     json.RawMessage `json:"data,omitempty"`
}

// batchCallbackJSON is how a callback is stored on the batch row; the
// trigger that enqueues it reads these fields.
type batchCallbackJSON struct {
	BatchCallback
	TimeoutMS int64 `json:"timeout_ms"`
	MaxWaitMS int64 `json:"max_wait_ms"`
}

func (c *BatchCallback) encode() ([]byte, error) {
	if c == nil {
		return nil, nil
	}
	if err := ledger.ValidateKey("callback kind", c.Kind); err != nil {
		return nil, err
	}
	if err := ledger.ValidateQueue(c.Queue); err != nil {
		return nil, fmt.Errorf("callback %w", err)
	}
	if len(c.Data) > 0 && !json.Valid(c.Data) {
		return nil, errors.New("callback data is not JSON")
	}
	return json.Marshal(batchCallbackJSON{BatchCallback: *c, TimeoutMS: c.Timeout.Milliseconds(), MaxWaitMS: c.MaxWait.Milliseconds()})
}

func decodeCallback(b []byte) *BatchCallback {
	if b == nil {
		return nil
	}
	var c batchCallbackJSON
	if json.Unmarshal(b, &c) != nil {
		return nil
	}
	c.BatchCallback.Timeout = time.Duration(c.TimeoutMS) * time.Millisecond
	c.BatchCallback.MaxWait = time.Duration(c.MaxWaitMS) * time.Millisecond
	return &c.BatchCallback
}

// NewBatch is what CreateBatch needs.
type NewBatch struct {
	// Description says what the batch is, for people ("billing run 2026-11").
	Description string
	// OnComplete is enqueued when every member has ended, whatever the
	// outcome; OnSuccess only when every member succeeded. Either or both
	// may be nil.
	OnComplete, OnSuccess *BatchCallback
}

// Batch is one batch row: its counters move in the same transaction as its
// members' status.
type Batch struct {
	ID          string
	Description string
	OnComplete  *BatchCallback
	OnSuccess   *BatchCallback
	// Total counts the members; the others count members by terminal status.
	Total, Succeeded, Dead, Discarded, Cancelled int
	// Generation counts completions: 1 after the first; a replayed member
	// reopens the batch and its next completion is generation 2.
	Generation int
	SealedAt   *time.Time
	// CompletedAt is set while the batch is complete; a reopened batch has
	// none until it completes again.
	CompletedAt *time.Time
	// CompleteJobID and SuccessJobID are the ledger ids of the newest
	// callback jobs, empty until one was enqueued.
	CompleteJobID, SuccessJobID string
	CreatedAt, UpdatedAt        time.Time
}

// Ended counts the members in a terminal status.
func (b Batch) Ended() int { return b.Succeeded + b.Dead + b.Discarded + b.Cancelled }

// Open reports whether the batch is not complete (being filled, or waiting
// for members).
func (b Batch) Open() bool { return b.CompletedAt == nil }

// State names where the batch stands: open (members may join), sealed
// (waiting for members), complete.
func (b Batch) State() string {
	switch {
	case b.CompletedAt != nil:
		return "complete"
	case b.SealedAt != nil:
		return "sealed"
	}
	return "open"
}

// CallbackKey is the business key of a batch's callback job for one event
// ("complete" or "success") and completion generation.
func CallbackKey(batchID, event string, generation int) string {
	return fmt.Sprintf("batch:%s:%s:%d", batchID, event, generation)
}

// batchOf is the Batch of a stored row.
func batchOf(r ledger.BatchRow, err error) (Batch, error) {
	return Batch{ID: r.ID, Description: r.Description, OnComplete: decodeCallback(r.OnComplete), OnSuccess: decodeCallback(r.OnSuccess),
		Total: r.Total, Succeeded: r.Succeeded, Dead: r.Dead, Discarded: r.Discarded, Cancelled: r.Cancelled,
		Generation: r.Generation, SealedAt: r.SealedAt, CompletedAt: r.CompletedAt, CompleteJobID: r.CompleteJobID,
		SuccessJobID: r.SuccessJobID, CreatedAt: r.CreatedAt, UpdatedAt: r.UpdatedAt}, err
}

// CreateBatch records an open batch in db (a pool or the caller's
// transaction, so that the batch and its first members commit with the
// caller's own writes).
func (s *Store) CreateBatch(ctx context.Context, db DB, nb NewBatch) (Batch, error) {
	if !utf8.ValidString(nb.Description) || strings.ContainsRune(nb.Description, 0) {
		return Batch{}, errors.New("keel: batch description must be valid UTF-8 without NUL bytes")
	}
	onComplete, err := nb.OnComplete.encode()
	if err != nil {
		return Batch{}, fmt.Errorf("keel: batch on_complete: %w", err)
	}
	onSuccess, err := nb.OnSuccess.encode()
	if err != nil {
		return Batch{}, fmt.Errorf("keel: batch on_success: %w", err)
	}
	id, err := uuid.NewV7()
	if err != nil {
		return Batch{}, err
	}
	b, err := batchOf(ledger.CreateBatch(ctx, db, id.String(), nb.Description, onComplete, onSuccess))
	return b, Interpret(err)
}

// SealBatch says every member has been enqueued: nothing joins the batch
// from now on, and once every member has ended (at once, if they all have)
// its callbacks are enqueued, in the same transaction. Sealing a sealed
// batch changes nothing.
func (s *Store) SealBatch(ctx context.Context, db DB, id string) (Batch, error) {
	if !utf8.ValidString(id) || id == "" {
		return Batch{}, fmt.Errorf("%w: %q", ErrBatchNotFound, id)
	}
	b, err := batchOf(ledger.SealBatch(ctx, db, id))
	return b, Interpret(err)
}

// GetBatch returns the batch with id.
func (s *Store) GetBatch(ctx context.Context, id string) (Batch, error) {
	if !utf8.ValidString(id) || id == "" {
		return Batch{}, fmt.Errorf("%w: %q", ErrBatchNotFound, id)
	}
	b, err := batchOf(ledger.GetBatch(ctx, s.pool, id))
	if errors.Is(err, pgx.ErrNoRows) {
		return Batch{}, fmt.Errorf("%w: %s", ErrBatchNotFound, id)
	}
	return b, Interpret(err)
}

// BatchFilter selects batches for ListBatches.
type BatchFilter struct {
	// Open lists only batches not complete.
	Open bool
	// Limit bounds the list (default 100), newest first.
	Limit int
}

// ListBatches returns batches, newest first.
func (s *Store) ListBatches(ctx context.Context, f BatchFilter) ([]Batch, error) {
	if f.Limit <= 0 {
		f.Limit = 100
	}
	rows, err := ledger.ListBatches(ctx, s.pool, f.Open, f.Limit)
	if err != nil {
		return nil, Interpret(err)
	}
	bs := make([]Batch, len(rows))
	for i, r := range rows {
		bs[i], _ = batchOf(r, nil)
	}
	return bs, nil
}

// BatchStatuses counts a batch's members by status, the open ones
// (waiting, pending, paused, running, failed) too.
func (s *Store) BatchStatuses(ctx context.Context, id string) (map[Status]int, error) {
	out, err := ledger.BatchStatuses(ctx, s.pool, id)
	return out, Interpret(err)
}

// OpenMembers returns up to limit members of a batch that have not ended
// (waiting, pending, paused, running, failed), oldest first.
func (s *Store) OpenMembers(ctx context.Context, id string, limit int) ([]Job, error) {
	if limit <= 0 {
		limit = 100
	}
	js, err := ledger.OpenMembers(ctx, s.pool, id, limit)
	return js, Interpret(err)
}
