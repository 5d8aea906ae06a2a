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
	err       error
}

// NewRaw makes a task from an already-encoded JSON payload, for tools (the
// CLI, the scheduler's config file) that do not know the Go payload type.
// Like New it refuses Key and Summary, when the task is enqueued.
func NewRaw(kind string, payload []byte, key string, opts ...Option) *Task {
	t := &Task{kind: kind, payload: payload}
	// A declared kind's defaults (queue, retries, timeout) apply to raw
	// tasks too, so a cron entry or the CLI behaves like Go code.
	if v, ok := registry.Load(kind); ok {
		t.s = v.(kindInfo).defaultSettings()
		t.s.queue = v.(kindInfo).Queue()
		t.kindQueue = t.s.queue
	}
	t.err = applyTaskOptions(&t.s, opts)
	if key != "" {
		t.s.key = key
	}
	if t.s.queue == "" {
		t.s.queue = DefaultQueue
	}
	return t
}

// Kind is the task's kind name.
func (t *Task) Kind() string { return t.kind }

// Payload is the task's JSON payload.
func (t *Task) Payload() []byte { return t.payload }

// BusinessKey names the business action the task performs.
func (t *Task) BusinessKey() string { return t.s.key }

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
