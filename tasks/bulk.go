package tasks

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/jobstore"
)

// TaskError is why a bulk enqueue refused its tasks: the task at Index (of
// the kind and business key named) is invalid. Nothing of the call was
// written. Err wraps one of ErrPayloadTooLarge, ErrInvalidKey,
// ErrUnknownQueue and ErrInvalidTask.
type TaskError struct {
	Index       int
	Kind        string
	BusinessKey string
	Err         error
}

func (e *TaskError) Error() string {
	return fmt.Sprintf("keel: enqueue many: task %d (%s, key %q): %v", e.Index, e.Kind, e.BusinessKey, e.Err)
}

func (e *TaskError) Unwrap() error { return e.Err }

// EnqueueMany is Enqueue for many tasks at once: it checks every task, writes
// them all in one transaction (one statement per jobstore.InsertChunkRows
// tasks), commits, and publishes the new jobs to Redis with several
// publishes in flight. The results are in the order of ts.
//
// Tasks are deduplicated by (kind, business key), among themselves too: the
// first task of a key creates the job (unless the ledger holds it), later
// ones get the same job with Existed = true. When one task is invalid the
// call returns a *TaskError naming it and writes nothing: it is all or
// nothing. When it returns nil every job will run: those Redis did not take
// (Published false) are published by the relay, like Enqueue's.
func (c *Client) EnqueueMany(ctx context.Context, ts ...*Task) ([]*Result, error) {
	ctx, span := c.startEnqueue(ctx, "enqueue_many", nil, len(ts))
	res, err := c.enqueueMany(ctx, ts, span)
	span.endMany(res, err)
	return res, err
}

func (c *Client) enqueueMany(ctx context.Context, ts []*Task, span enqueueSpan) ([]*Result, error) {
	njs, err := c.validateMany(ts, span)
	if err != nil {
		return nil, err
	}
	ins, err := c.store.InsertMany(ctx, c.store.Pool(), njs, jobstore.InsertOptions{Claim: true})
	if err != nil {
		return nil, fmt.Errorf("keel: enqueue many: %w", err)
	}
	res := results(njs, ins)
	var pub []*Result
	for _, r := range res {
		if !r.Existed && r.Job.Status == idempotency.StatusPending {
			pub = append(pub, r)
		}
	}
	c.publish(ctx, pub)
	return res, nil
}

// EnqueueManyTx is EnqueueTx for many tasks: it writes them in the caller's
// transaction (one statement per jobstore.InsertChunkRows tasks) and
// wakes the relays once, at commit, to publish them. Deduplication and
// validation are EnqueueMany's: one invalid task and nothing is written,
// the transaction is left as it was.
func (c *Client) EnqueueManyTx(ctx context.Context, tx pgx.Tx, ts ...*Task) ([]*Result, error) {
	ctx, span := c.startEnqueue(ctx, "enqueue_many", nil, len(ts))
	res, err := c.enqueueManyTx(ctx, tx, ts, span)
	span.endMany(res, err)
	return res, err
}

func (c *Client) enqueueManyTx(ctx context.Context, tx pgx.Tx, ts []*Task, span enqueueSpan) ([]*Result, error) {
	njs, err := c.validateMany(ts, span)
	if err != nil {
		return nil, err
	}
	ins, err := c.store.InsertMany(ctx, tx, njs, jobstore.InsertOptions{WakeRelay: true})
	if err != nil {
		return nil, fmt.Errorf("keel: enqueue many: %w", err)
	}
	return results(njs, ins), nil
}

// Check reports whether Enqueue, EnqueueTx and EnqueueMany would accept
// every task, without writing anything: the first they would refuse comes
// back as a *TaskError that names it. A caller that enqueues in several
// calls can check the whole lot before the first.
func (c *Client) Check(ts ...*Task) error {
	_, err := c.validateAll(ts, enqueueSpan{})
	return err
}

// CheckTasks is Check for a client whose ClientConfig.Queues are queues
// (nil: DefaultQueues), without one: for a dry run that connects to
// nothing.
func CheckTasks(queues []string, ts ...*Task) error {
	set, err := queueSet(queues)
	if err != nil {
		return err
	}
	return (&Client{queues: set}).Check(ts...)
}

func (c *Client) validateAll(ts []*Task, span enqueueSpan) ([]jobstore.NewJob, error) {
	njs := make([]jobstore.NewJob, len(ts))
	for i, t := range ts {
		nj, err := c.validate(t)
		if err != nil {
			e := &TaskError{Index: i, Err: err}
			if t != nil {
				e.Kind, e.BusinessKey = t.kind, t.s.key
			}
			return nil, e
		}
		span.apply(&nj)
		njs[i] = nj
	}
	return njs, nil
}

// validateMany is validateAll for the bulk calls, which write no
// dependencies: one statement cannot lock each task's parents first.
func (c *Client) validateMany(ts []*Task, span enqueueSpan) ([]jobstore.NewJob, error) {
	njs, err := c.validateAll(ts, span)
	if err != nil {
		return nil, err
	}
	for i, nj := range njs {
		if len(nj.After) > 0 {
			return nil, &TaskError{Index: i, Kind: nj.Kind, BusinessKey: nj.BusinessKey,
				Err: fmt.Errorf("%w: a task with tasks.After goes through Enqueue, EnqueueTx or a Workflow, not EnqueueMany", ErrInvalidTask)}
		}
	}
	return njs, nil
}

func results(njs []jobstore.NewJob, ins []jobstore.Inserted) []*Result {
	res := make([]*Result, len(ins))
	for i, in := range ins {
		res[i] = newResult(in.Job, in.Existed, njs[i].Payload)
	}
	return res
}

// publishGiveUp bounds the handing back of jobs Redis refused when the
// caller's context has ended.
const publishGiveUp = 10 * time.Second

// publish hands the jobs of rs to Redis with Store.PublishMany and sets
// their Published. New rows were written claimed (marked
// published); those Redis did not take are handed back to the relay in one
// statement. An existing row that was not yet published is marked by
// PublishMany once Redis holds it.
func (c *Client) publish(ctx context.Context, rs []*Result) {
	if len(rs) == 0 {
		return
	}
	jobs := make([]idempotency.Job, len(rs))
	for i, r := range rs {
		jobs[i] = r.Job
	}
	out, markErr := c.store.PublishMany(ctx, c.pub, jobs)
	if markErr != nil {
		c.log.Warn("keel: published jobs not marked; the relay's second publish is harmless", "err", markErr)
	}
	var back []string
	var firstErr error
	for i, r := range rs {
		if out[i].Err == nil {
			r.Published = true
			continue
		}
		if firstErr == nil {
			firstErr = out[i].Err
		}
		if !r.Existed {
			back = append(back, r.Job.ID)
			r.Job.PublishedAt = nil
		}
	}
	if firstErr == nil {
		return
	}
	c.log.Warn("keel: publish deferred to the relay", "jobs", len(back), "kind", rs[0].Job.Kind, "err", firstErr)
	if len(back) == 0 {
		return
	}
	uctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), publishGiveUp)
	defer cancel()
	if err := c.store.Unpublish(uctx, back); err != nil {
		// The rows stay claimed: the reconciler publishes them after its grace.
		c.log.Warn("keel: jobs not handed back to the relay; the reconciler publishes them", "jobs", len(back), "err", err)
	}
}

// Group commit of Enqueue: up to maxInsertBatch waiting calls share one
// statement; insertLoops statements may run at once. One loop measured
// faster than two with 16 producers (`keel bench`: bigger batches, and no
// two inserts competing for the same index pages).
const (
	insertLoops    = 1
	maxInsertBatch = 256
)

type insertReq struct {
	nj  jobstore.NewJob
	out chan insertOut
}

type insertOut struct {
	res *Result
	err error
}

// insert writes nj through the group commit and publishes its job.
func (c *Client) insert(ctx context.Context, nj jobstore.NewJob) (*Result, error) {
	r := insertReq{nj: nj, out: make(chan insertOut, 1)}
	if err := c.inserts.Submit(ctx, r); err != nil {
		return nil, err
	}
	select {
	case o := <-r.out:
		return o.res, o.err
	case <-c.inserts.Closed():
		// The batch may have run; if it did, the row is claimed and the
		// reconciler publishes it.
		return nil, ErrClientClosed
	}
}

// insertBatch writes the jobs of waiting Enqueue calls in one statement and
// one commit, then publishes them in the background while the loop takes
// the next calls: a round's publish overlaps the next round's commit.
func (c *Client) insertBatch(ctx context.Context, reqs []insertReq) <-chan struct{} {
	njs := make([]jobstore.NewJob, len(reqs))
	for i, r := range reqs {
		njs[i] = r.nj
	}
	ins, err := c.store.InsertMany(ctx, c.store.Pool(), njs, jobstore.InsertOptions{Claim: true})
	if err != nil {
		for _, r := range reqs {
			r.out <- insertOut{err: err}
		}
		return nil
	}
	res := results(njs, ins)
	var pub []*Result
	for _, r := range res {
		// New rows (not one held for its concurrency key), and an existing
		// one that no publisher has claimed.
		if r.Job.Status == idempotency.StatusPending && (!r.Existed || r.Job.PublishedAt == nil) {
			pub = append(pub, r)
		}
	}
	outs := make([]chan insertOut, len(reqs))
	for i, r := range reqs {
		outs[i] = r.out
	}
	settled := make(chan struct{})
	c.publishing.Go(func() {
		defer close(settled)
		// Not the round's context: Close cancels that, and a publish cut
		// short only hands the jobs to the relay.
		c.publish(context.WithoutCancel(ctx), pub)
		for i, out := range outs {
			out <- insertOut{res: res[i]}
		}
	})
	return settled
}
