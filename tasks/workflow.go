package tasks

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sort"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/keeljobs/keel/internal/jobstore"
	"github.com/keeljobs/keel/internal/ledger"
)

// Errors a job with dependencies is refused with.
var (
	// ErrUnknownParent: a job was to wait for a job that does not exist.
	ErrUnknownParent = jobstore.ErrUnknownParent
	// ErrParentEnded: a job was to wait for a job that was cancelled or
	// discarded, which would never succeed.
	ErrParentEnded = jobstore.ErrParentEnded
	// ErrCycle: a workflow's tasks wait for each other in a circle.
	ErrCycle = errors.New("keel: workflow has a cycle")
)

// After makes the job wait until every job jobIDs names has succeeded.
// Until then it is waiting (idempotency.StatusWaiting): accepted,
// recorded, shown with what it waits for, and not published. The parent
// whose success is the last one releases it in the same transaction that
// records that success, so the job is released once, through crashes and
// a Redis that lost its data. A parent that dies leaves it waiting (a
// replay that succeeds releases it); a parent cancelled or discarded
// cancels it. A parent that does not exist, or was cancelled or
// discarded, fails the enqueue (ErrUnknownParent, ErrParentEnded).
//
// Enqueue, EnqueueTx and a Workflow's tasks take it; EnqueueMany refuses
// it. Enqueueing a dependent locks its parents' ledger rows until its
// transaction commits, which holds up a parent's completion meanwhile:
// keep an EnqueueTx that names parents short.
func After(jobIDs ...string) Option {
	refs := make([]jobstore.Ref, len(jobIDs))
	for i, id := range jobIDs {
		refs[i] = jobstore.Ref{ID: id}
	}
	return afterOption(refs)
}

// AfterKey is After for the job of kind with business key.
func AfterKey(kind, key string) Option {
	return afterOption([]jobstore.Ref{{Kind: kind, Key: key}})
}

func afterOption(refs []jobstore.Ref) Option {
	return optionFunc(func(s *settings) { s.after = append(slices.Clip(s.after), refs...) })
}

// Workflow is a set of named tasks, some waiting for others (fan-out,
// fan-in, any graph without cycles), enqueued in one call and one
// transaction: every job of it is written, or none. Each task is an
// ordinary job with its own kind, key, retries and dead letters; a task
// runs once every task it comes after has succeeded (see After for what a
// death or a cancel does). The workflow's id groups its jobs for `keel
// workflow show` and the dashboard; it is the caller's, like a business
// key (e.g. "order-123-fulfilment").
//
// Enqueueing the same workflow again dedupes each task by its key, as
// Enqueue does: the jobs that exist are returned with Existed set and keep
// the parents they were first given.
type Workflow struct {
	id    string
	tasks []workflowTask
	err   error
}

type workflowTask struct {
	name  string
	t     *Task
	after []string
}

// NewWorkflow starts a workflow with id.
func NewWorkflow(id string) *Workflow { return &Workflow{id: id} }

// Add adds task t under name, to run after the tasks named after (added
// before or after it). Errors (a name used twice, an empty name) are
// reported by the enqueue.
func (w *Workflow) Add(name string, t *Task, after ...string) *Workflow {
	if w.err == nil {
		for _, x := range w.tasks {
			if x.name == name {
				w.err = fmt.Errorf("%w: workflow %s: task %q added twice", ErrInvalidTask, w.id, name)
			}
		}
	}
	w.tasks = append(w.tasks, workflowTask{name: name, t: t, after: slices.Clone(after)})
	return w
}

// WorkflowResult is what enqueueing a workflow did.
type WorkflowResult struct {
	ID string
	// Tasks are each task's result, by name.
	Tasks map[string]*Result
}

// EnqueueWorkflow writes every job of w in one transaction; the relay
// publishes each as it is released (the tasks that wait for nothing at
// once).
func (c *Client) EnqueueWorkflow(ctx context.Context, w *Workflow) (*WorkflowResult, error) {
	var res *WorkflowResult
	err := pgx.BeginFunc(ctx, c.store.Pool(), func(tx pgx.Tx) error {
		var err error
		res, err = c.EnqueueWorkflowTx(ctx, tx, w)
		return err
	})
	if err != nil {
		return nil, err
	}
	return res, nil
}

// EnqueueWorkflowTx writes every job of w inside the caller's transaction:
// if it commits the workflow runs; if it rolls back it never existed.
func (c *Client) EnqueueWorkflowTx(ctx context.Context, tx pgx.Tx, w *Workflow) (*WorkflowResult, error) {
	order, njs, err := c.planWorkflow(w)
	if err != nil {
		return nil, err
	}
	res := &WorkflowResult{ID: w.id, Tasks: make(map[string]*Result, len(order))}
	for _, i := range order {
		x, nj := w.tasks[i], njs[i]
		for _, p := range x.after {
			nj.After = append(nj.After, jobstore.Ref{ID: res.Tasks[p].Job.ID})
		}
		job, existed, err := c.store.Insert(ctx, tx, nj)
		if err != nil {
			return nil, fmt.Errorf("keel: workflow %s: task %s: %w", w.id, x.name, err)
		}
		res.Tasks[x.name] = newResult(job, existed, nj.Payload)
	}
	return res, nil
}

// planWorkflow checks w and returns its tasks in an order where every
// task comes after those it waits for, with the rows to write.
func (c *Client) planWorkflow(w *Workflow) ([]int, []jobstore.NewJob, error) {
	if w == nil {
		return nil, nil, fmt.Errorf("%w: nil workflow", ErrInvalidTask)
	}
	if err := ledger.ValidateKey("workflow id", w.id); err != nil {
		return nil, nil, fmt.Errorf("%w: %v", ErrInvalidTask, err)
	}
	if w.err != nil {
		return nil, nil, w.err
	}
	if len(w.tasks) == 0 {
		return nil, nil, fmt.Errorf("%w: workflow %s has no tasks", ErrInvalidTask, w.id)
	}
	index := make(map[string]int, len(w.tasks))
	for i, x := range w.tasks {
		if err := ledger.ValidateKey("workflow task name", x.name); err != nil {
			return nil, nil, fmt.Errorf("%w: workflow %s: %v", ErrInvalidTask, w.id, err)
		}
		index[x.name] = i
	}
	njs := make([]jobstore.NewJob, len(w.tasks))
	waits := make([]int, len(w.tasks))
	next := make([][]int, len(w.tasks))
	for i, x := range w.tasks {
		nj, err := c.validate(x.t)
		if err != nil {
			return nil, nil, fmt.Errorf("keel: workflow %s: task %s: %w", w.id, x.name, err)
		}
		nj.WorkflowID, nj.WorkflowTask = w.id, x.name
		njs[i] = nj
		for _, p := range x.after {
			j, ok := index[p]
			if !ok {
				return nil, nil, fmt.Errorf("%w: workflow %s: task %s comes after %q, which is not one of its tasks", ErrInvalidTask, w.id, x.name, p)
			}
			if j == i {
				return nil, nil, fmt.Errorf("%w: workflow %s: task %s comes after itself", ErrCycle, w.id, x.name)
			}
			waits[i]++
			next[j] = append(next[j], i)
		}
	}
	// Kahn's algorithm: what is left once no task is free is a cycle.
	var order, free []int
	for i := range w.tasks {
		if waits[i] == 0 {
			free = append(free, i)
		}
	}
	for len(free) > 0 {
		i := free[0]
		free = free[1:]
		order = append(order, i)
		for _, j := range next[i] {
			if waits[j]--; waits[j] == 0 {
				free = append(free, j)
			}
		}
	}
	if len(order) < len(w.tasks) {
		var stuck []string
		for i, n := range waits {
			if n > 0 {
				stuck = append(stuck, w.tasks[i].name)
			}
		}
		sort.Strings(stuck)
		return nil, nil, fmt.Errorf("%w: workflow %s: tasks %s wait for each other", ErrCycle, w.id, strings.Join(stuck, ", "))
	}
	return order, njs, nil
}

// enqueueDependent is Enqueue for a job with parents: its own
// transaction, which locks them (jobstore's Insert begins it); the relay
// publishes the job once it is released.
func (c *Client) enqueueDependent(ctx context.Context, nj jobstore.NewJob) (*Result, error) {
	job, existed, err := c.store.Insert(ctx, c.store.Pool(), nj)
	if err != nil {
		return nil, fmt.Errorf("keel: enqueue %s: %w", nj.Kind, err)
	}
	return newResult(job, existed, nj.Payload), nil
}
