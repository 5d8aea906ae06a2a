package tasks

import (
	"context"
	"encoding/json"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/jobstore"
)

// InBatch makes the task a member of the open batch id (Client.NewBatch).
// Enqueueing into a sealed batch fails with ErrBatchSealed. A
// task whose (kind, business key) is in the ledger already is not added:
// the result has Existed set and its Job.BatchID says where that job is.
func InBatch(id string) Option { return optionFunc(func(s *settings) { s.batchID = id }) }

// Batch is one batch row: its counters move in the same transaction as its
// members' status.
type Batch = jobstore.Batch

var (
	// ErrBatchSealed means a job was enqueued into a batch that is sealed:
	// its members are all known, nothing joins it any more.
	ErrBatchSealed = jobstore.ErrBatchSealed
	// ErrBatchNotFound means no batch has the id given.
	ErrBatchNotFound = jobstore.ErrBatchNotFound
)

// BatchCounts counts a batch's members by outcome.
type BatchCounts struct {
	Total     int `json:"total"`
	Succeeded int `json:"succeeded"`
	Dead      int `json:"dead"`
	Discarded int `json:"discarded"`
	Cancelled int `json:"cancelled"`
}

// Batch callback events.
const (
	BatchComplete = "complete" // every member ended, whatever the outcome
	BatchSuccess  = "success"  // every member succeeded
)

// BatchDone is the payload of a batch's callback job (declare its kind with
// DefineBatchDone). Generation is 1 for the first completion; a replayed
// member reopens the batch and its next completion enqueues a new callback
// with Generation 2, so a handler can tell a repeat from the first.
type BatchDone struct {
	BatchID     string      `json:"batch_id"`
	Generation  int         `json:"generation"`
	Event       string      `json:"event"`
	Description string      `json:"description"`
	Counts      BatchCounts `json:"counts"`
	// Data is the callback's own payload, given to BatchCallback.
	Data json.RawMessage `json:"data"`
}

// Key is the callback job's business key: the batch, the event and the
// generation, so the ledger holds one callback job per completion.
func (d BatchDone) Key() string { return jobstore.CallbackKey(d.BatchID, d.Event, d.Generation) }

// DefineBatchDone declares a kind of batch callback: its handlers receive a
// BatchDone. opts are Define's (queue, retries, timeout).
func DefineBatchDone(name string, opts ...Option) *Kind[BatchDone] {
	return Define[BatchDone](name, append([]Option{Key(BatchDone.Key)}, opts...)...)
}

// BatchCallback makes the callback task of kind k for BatchSpec: data (any
// JSON-encodable value, nil for none) reaches the handler as BatchDone.Data.
func BatchCallback(k *Kind[BatchDone], data any, opts ...Option) *Task {
	t := &Task{kind: k.name, s: k.defaults, kindQueue: k.Queue()}
	t.err = applyTaskOptions(&t.s, opts)
	if t.s.queue == "" {
		t.s.queue = DefaultQueue
	}
	b, err := json.Marshal(data)
	if err != nil && t.err == nil {
		t.err = fmt.Errorf("%w: callback data does not encode: %v", ErrInvalidTask, err)
	}
	t.payload = b
	return t
}

// BatchSpec describes a batch: what it is, and what to enqueue when it
// completes. Either callback may be nil. A callback task's payload is its
// data (BatchDone.Data); its business key is ignored (keel derives it from
// the batch); its kind, queue, retries, timeout and max wait apply.
type BatchSpec struct {
	Description string
	// OnComplete is enqueued when the batch is sealed and every member has
	// ended: succeeded, dead, discarded or cancelled.
	OnComplete *Task
	// OnSuccess is enqueued, besides OnComplete, when every member succeeded.
	OnSuccess *Task
}

// NewBatch records an open batch. Enqueue its members with InBatch(b.ID),
// then SealBatch: its callbacks are enqueued once it is sealed and every
// member has ended, exactly once per completion.
func (c *Client) NewBatch(ctx context.Context, spec BatchSpec) (Batch, error) {
	return c.newBatch(ctx, c.store.Pool(), spec)
}

// NewBatchTx is NewBatch in the caller's transaction: the batch, its first
// members (EnqueueTx, EnqueueManyTx) and the caller's own writes commit
// together, or none of them.
func (c *Client) NewBatchTx(ctx context.Context, tx pgx.Tx, spec BatchSpec) (Batch, error) {
	return c.newBatch(ctx, tx, spec)
}

func (c *Client) newBatch(ctx context.Context, db jobstore.DB, spec BatchSpec) (Batch, error) {
	var nb jobstore.NewBatch
	nb.Description = spec.Description
	var err error
	if nb.OnComplete, err = c.callback(spec.OnComplete); err != nil {
		return Batch{}, fmt.Errorf("keel: new batch: on complete: %w", err)
	}
	if nb.OnSuccess, err = c.callback(spec.OnSuccess); err != nil {
		return Batch{}, fmt.Errorf("keel: new batch: on success: %w", err)
	}
	b, err := c.store.CreateBatch(ctx, db, nb)
	if err != nil {
		return Batch{}, fmt.Errorf("keel: new batch: %w", err)
	}
	return b, nil
}

// callback checks a callback task as an enqueue would (its key aside).
func (c *Client) callback(t *Task) (*jobstore.BatchCallback, error) {
	if t == nil {
		return nil, nil
	}
	if t.s.batchID != "" {
		return nil, fmt.Errorf("%w: a callback cannot be a member of a batch", ErrInvalidTask)
	}
	probe := *t
	probe.s.key = "batch-callback" // keel derives the real one
	nj, err := c.validate(&probe)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", t.kind, err)
	}
	data := json.RawMessage(t.payload)
	if len(data) > 0 && !json.Valid(data) {
		return nil, fmt.Errorf("%w: %s: payload is not JSON", ErrInvalidTask, t.kind)
	}
	return &jobstore.BatchCallback{Kind: nj.Kind, Queue: nj.Queue, MaxRetry: nj.MaxRetry,
		Timeout: nj.Timeout, MaxWait: nj.MaxWait, Data: data}, nil
}

// SealBatch says every member is enqueued. From then on enqueueing into the
// batch fails with ErrBatchSealed, and once every member has
// ended (at once, if they all have) the callbacks are enqueued. Sealing a
// sealed batch changes nothing.
func (c *Client) SealBatch(ctx context.Context, id string) (Batch, error) {
	return c.store.SealBatch(ctx, c.store.Pool(), id)
}

// SealBatchTx is SealBatch in the caller's transaction.
func (c *Client) SealBatchTx(ctx context.Context, tx pgx.Tx, id string) (Batch, error) {
	return c.store.SealBatch(ctx, tx, id)
}

// enqueueMember is Enqueue for a batch member: its own statement, then a
// publish, as EnqueueMany does for one task.
func (c *Client) enqueueMember(ctx context.Context, nj jobstore.NewJob) (*Result, error) {
	ins, err := c.store.InsertMany(ctx, c.store.Pool(), []jobstore.NewJob{nj}, jobstore.InsertOptions{Claim: true})
	if err != nil {
		return nil, fmt.Errorf("keel: enqueue %s: %w", nj.Kind, err)
	}
	res := results([]jobstore.NewJob{nj}, ins)
	if !res[0].Existed && res[0].Job.Status == idempotency.StatusPending {
		c.publish(ctx, res)
	}
	return res[0], nil
}
