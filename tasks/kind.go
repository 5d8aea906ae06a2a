package tasks

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/hibiken/asynq"

	"github.com/keeljobs/keel/internal/jobstore"
	"github.com/keeljobs/keel/internal/ledger"
	"github.com/keeljobs/keel/retry"
)

// MaxPayloadBytes is the largest payload keel accepts. Large data travels by
// id (a row, an object key), not inside the job.
const MaxPayloadBytes = 256 << 10

// DefaultMaxRetry is a kind's retry budget when it sets none.
const DefaultMaxRetry = 10

// DefaultQueue is where a kind's jobs go when it names no queue.
const DefaultQueue = "default"

// settings are the options of a kind or one task; a task's own override the
// kind's.
type settings struct {
	queue       string
	maxRetry    *int
	timeout     time.Duration
	maxWait     time.Duration
	deadline    time.Time
	expireStale bool
	delay       time.Duration
	processAt   time.Time
	key         string
	traceID     string
	unique      time.Duration
	batchID     string
	after       []jobstore.Ref
}

// Option sets a default of a kind (in Define) or of one task (in New).
type Option interface{ apply(*settings) }

type optionFunc func(*settings)

func (f optionFunc) apply(s *settings) { f(s) }

// Queue puts jobs on queue q (critical, default, low, or one of your own).
func Queue(q string) Option { return optionFunc(func(s *settings) { s.queue = q }) }

// MaxRetry bounds how many times a job is retried after its first attempt.
func MaxRetry(n int) Option { return optionFunc(func(s *settings) { s.maxRetry = &n }) }

// Timeout bounds one attempt; the handler's context is cancelled after d,
// rounded up to a whole second (asynq keeps timeouts in seconds).
func Timeout(d time.Duration) Option { return optionFunc(func(s *settings) { s.timeout = d }) }

// MaxWait is the ceiling on the total time a job may spend waiting (rate
// limits, concurrency slots, an HTTP 429/503's Retry-After: retry.Wait) —
// waits do not use up attempts, so without a ceiling a job could wait
// forever. Past it the job dies with class waited_too_long. Default: the
// worker's server.GuardConfig.MaxWait (24h).
func MaxWait(d time.Duration) Option { return optionFunc(func(s *settings) { s.maxWait = d }) }

// Deadline bounds every attempt to end before t. A job still waiting when
// t passes (a backlog, a retry that would come after it) never runs: keel
// records it as a dead letter of class deadline, alerted, or, with
// ExpireAtDeadline, drops it as expired. An enqueue whose Delay or
// ProcessAt is not before t is refused (idempotency.ErrPastDeadline).
func Deadline(t time.Time) Option { return optionFunc(func(s *settings) { s.deadline = t }) }

// ExpireAtDeadline says stale work has no value (a notification, a cache
// refresh): a job still waiting when its Deadline passes is discarded with
// class expired — no dead letter, no alert, and nothing a person replays
// by mistake — instead of dying for a person. It does nothing without a
// Deadline.
func ExpireAtDeadline() Option { return optionFunc(func(s *settings) { s.expireStale = true }) }

// Delay runs the job no earlier than d after it is enqueued.
func Delay(d time.Duration) Option { return optionFunc(func(s *settings) { s.delay = d }) }

// ProcessAt runs the job no earlier than t.
func ProcessAt(t time.Time) Option { return optionFunc(func(s *settings) { s.processAt = t }) }

// BusinessKey overrides the kind's key function for one task.
func BusinessKey(key string) Option { return optionFunc(func(s *settings) { s.key = key }) }

// Unique bounds how long a finished job dedupes its key: "one welcome mail
// per user per 10 minutes" is tasks.Unique(10*time.Minute) on the kind.
// Without it a key dedupes for as long as the ledger keeps the job (its
// retention, 30 days by default).
//
// The window counts from the finished job's creation. Once it has passed, an
// enqueue of the same key makes a new job; the old one keeps its record
// (idempotency.Job.SupersededAt) and no longer answers to the key. A job
// that is still open — pending, running, or failed and waiting to retry —
// always dedupes, however old: keel never runs two jobs of one key at once;
// a newer job of the key does not start while a handler of an older one
// that keel gave up (timed out, cancelled) may still be running.
// Dead and cancelled jobs count as finished; a dead job that was superseded
// cannot be replayed (enqueue anew instead).
func Unique(window time.Duration) Option {
	return optionFunc(func(s *settings) { s.unique = window })
}

// TraceID attaches a log/trace id to the job (kept with it if it dies).
func TraceID(id string) Option { return optionFunc(func(s *settings) { s.traceID = id }) }

// kindOption is an option only Define takes: it concerns every task of a
// kind (its key function, its summary), so New and NewRaw refuse it rather
// than ignore it.
type kindOption interface {
	Option
	kindOnly() string
}

type keyOption[P any] struct{ fn func(P) string }

func (keyOption[P]) apply(*settings) {}
func (keyOption[P]) kindOnly() string {
	var p P
	return fmt.Sprintf("tasks.Key[%T]", p)
}

// Key sets the function that names a payload's business action: two tasks
// with the same kind and key are one job. Required in Define.
func Key[P any](fn func(P) string) Option { return keyOption[P]{fn: fn} }

type summaryOption[P any] struct{ fn func(P) string }

func (summaryOption[P]) apply(*settings) {}
func (summaryOption[P]) kindOnly() string {
	var p P
	return fmt.Sprintf("tasks.Summary[%T]", p)
}

// Summary sets how a dead job's payload is shown to people. Use it to redact
// secrets: the default shows the first 512 bytes of the JSON payload.
func Summary[P any](fn func(P) string) Option { return summaryOption[P]{fn: fn} }

type concurrencyOption[P any] struct {
	fn    func(P) string
	limit int
}

func (concurrencyOption[P]) apply(*settings) {}
func (concurrencyOption[P]) kindOnly() string {
	var p P
	return fmt.Sprintf("tasks.ConcurrencyKey[%T]", p)
}

// ConcurrencyKey gives every tenant of a kind a fair share: fn names the
// partition a payload belongs to (a customer, an account), and at most
// limit jobs of one partition are in flight at once across all workers —
// pending, running, or failed and waiting to retry (a retry keeps its
// slot). The others are held in the ledger, never handed to Redis, and do
// not spend attempts; when one of the partition's jobs ends (succeeded,
// dead, discarded, cancelled) the oldest held one is released in the same
// transaction. Another partition's job therefore never queues behind a
// flood. fn returning "" leaves that task unlimited. Define panics when
// limit is below 1. See docs/fairness.md.
func ConcurrencyKey[P any](fn func(P) string, limit int) Option {
	return concurrencyOption[P]{fn: fn, limit: limit}
}

// Kind is a declared task kind: a name, a payload type, a business-key
// function and default options.
type Kind[P any] struct {
	name     string
	key      func(P) string
	summary  func(P) string
	ckey     func(P) string
	climit   int
	defaults settings
	keep     keepSet
}

// Define declares a kind; a program then lists its kinds in NewKinds for
// what needs them by name. It panics when name is empty, no Key is given, or
// a Key or Summary is for another payload type, as kinds are declared once
// at package level and such a mistake must stop the program at start.
func Define[P any](name string, opts ...Option) *Kind[P] {
	if name == "" {
		panic("keel: tasks.Define with an empty kind name")
	}
	k := &Kind[P]{name: name}
	var keeps []keepOption
	for _, o := range opts {
		switch o := o.(type) {
		case keepOption:
			keeps = append(keeps, o)
		case keyOption[P]:
			k.key = o.fn
		case summaryOption[P]:
			k.summary = o.fn
		case concurrencyOption[P]:
			if o.fn == nil || o.limit < 1 {
				panic(fmt.Sprintf("keel: kind %q: tasks.ConcurrencyKey needs a function and a limit of at least 1 (got %d)", name, o.limit))
			}
			k.ckey, k.climit = o.fn, o.limit
		case kindOption:
			var p P
			panic(fmt.Sprintf("keel: kind %q: %s does not apply to a payload of type %T", name, o.kindOnly(), p))
		default:
			o.apply(&k.defaults)
		}
	}
	for _, o := range keeps { // after Unique, wherever it was given
		k.keep = k.keep.add(name, k.defaults.unique, o)
	}
	if k.key == nil {
		var p P
		panic(fmt.Sprintf("keel: kind %q has no tasks.Key[%T] option", name, p))
	}
	if q := k.defaults.queue; q != "" {
		if err := ledger.ValidateQueue(q); err != nil {
			panic(fmt.Sprintf("keel: kind %q: tasks.Queue: %v", name, err))
		}
	}
	return k
}

// Name is the kind's name (the asynq task type).
func (k *Kind[P]) Name() string { return k.name }

// Queue is the queue the kind's jobs go to by default.
func (k *Kind[P]) Queue() string {
	if k.defaults.queue == "" {
		return DefaultQueue
	}
	return k.defaults.queue
}

// New makes a task of this kind. Errors (an unencodable payload, or Key or
// Summary, which only Define takes — use BusinessKey for one task's key) are
// reported when it is enqueued, with ErrInvalidTask.
func (k *Kind[P]) New(p P, opts ...Option) *Task {
	t := &Task{kind: k.name, s: k.defaults, kindQueue: k.Queue()}
	optErr := applyTaskOptions(&t.s, opts)
	if t.s.queue == "" {
		t.s.queue = DefaultQueue
	}
	var err error
	if t.payload, err = json.Marshal(p); err != nil {
		t.err = fmt.Errorf("%w: payload does not encode: %v", ErrInvalidTask, err)
		return t
	}
	if t.s.key == "" {
		t.s.key = k.key(p)
	}
	if k.summary != nil {
		t.summary = k.summary(p)
	}
	k.concurrency(t, p)
	t.err = optErr
	return t
}

// concurrency sets t's concurrency key and limit from p, when the kind
// has a ConcurrencyKey.
func (k *Kind[P]) concurrency(t *Task, p P) {
	if k.ckey != nil {
		if t.ckey = k.ckey(p); t.ckey != "" {
			t.climit = k.climit
		}
	}
}

// applyTaskOptions applies one task's options, refusing those only Define
// takes.
func applyTaskOptions(s *settings, opts []Option) error {
	for _, o := range opts {
		if ko, ok := o.(kindOption); ok {
			return fmt.Errorf("%w: %s is an option of tasks.Define, not of one task (use tasks.BusinessKey for one task's key)",
				ErrInvalidTask, ko.kindOnly())
		}
		o.apply(s)
	}
	return nil
}

// Decode reads a payload of this kind. A payload that does not decode is a
// permanent failure: retrying cannot fix it.
func (k *Kind[P]) Decode(b []byte) (P, error) {
	var p P
	if err := json.Unmarshal(b, &p); err != nil {
		return p, retry.Permanent(fmt.Errorf("keel: %s payload does not decode: %w", k.name, err))
	}
	return p, nil
}

// Handler adapts fn, which takes the typed payload, to an asynq.Handler.
func (k *Kind[P]) Handler(fn func(ctx context.Context, p P) error) asynq.Handler {
	return asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
		p, err := k.Decode(t.Payload())
		if err != nil {
			return err
		}
		return fn(ctx, p)
	})
}
