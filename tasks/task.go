package tasks

import (
	"time"

	"github.com/keeljobs/keel/internal/jobstore"
)

// Task is one unit of work of a kind, ready to enqueue.
type Task struct {
	kind    string
	payload []byte
	summary string
	s       settings
	// kindQueue is the queue the task's declared kind names: clients
	// accept it for this task besides their own queues.
	kindQueue string
	// ckey and climit: the task's concurrency key under its kind's
	// ConcurrencyKey, and the key's limit (empty: none).
	ckey   string
	climit int
	err    error
}

// NewRaw makes a task of no declared kind from an already-encoded JSON
// payload: only opts and the defaults of every task apply. For a kind the
// program declares, Kinds.NewRaw gives the task the kind's defaults.
func NewRaw(kind string, payload []byte, key string, opts ...Option) *Task {
	return (*Kinds)(nil).NewRaw(kind, payload, key, opts...)
}

// Kind is the task's kind name.
func (t *Task) Kind() string { return t.kind }

// Payload is the task's JSON payload.
func (t *Task) Payload() []byte { return t.payload }

// BusinessKey names the business action the task performs.
func (t *Task) BusinessKey() string { return t.s.key }

// ConcurrencyKey is the task's partition under its kind's
// tasks.ConcurrencyKey and that partition's limit; "" and 0 when none.
func (t *Task) ConcurrencyKey() (key string, limit int) { return t.ckey, t.climit }

// Queue is the queue the task goes to.
func (t *Task) Queue() string { return t.s.queue }

// RunAt is when the task may run first; zero means now.
func (t *Task) RunAt(now time.Time) time.Time {
	switch {
	case !t.s.processAt.IsZero():
		return t.s.processAt
	case t.s.delay > 0:
		return now.Add(t.s.delay)
	}
	return time.Time{}
}

// HeaderBusinessKey carries a job's business key in its asynq task's
// headers (asynqmon shows them), so logs can name it without a ledger read.
const HeaderBusinessKey = jobstore.HeaderBusinessKey
