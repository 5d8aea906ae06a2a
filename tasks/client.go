package tasks

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	"go.opentelemetry.io/otel/trace"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/inspect"
	"github.com/keeljobs/keel/internal/batch"
	"github.com/keeljobs/keel/internal/jobstore"
	"github.com/keeljobs/keel/internal/ledger"
	"github.com/keeljobs/keel/internal/redisconn"
	"github.com/keeljobs/keel/internal/tracing"
)

// ErrClientClosed is returned by calls made after Close.
var ErrClientClosed = errors.New("keel: tasks client closed")

// Errors an enqueue is refused with; the returned error wraps one of them and
// names the kind and the offending value.
var (
	ErrPayloadTooLarge = errors.New("payload too large")
	ErrInvalidKey      = errors.New("invalid business key")
	ErrUnknownQueue    = errors.New("unknown queue")
	ErrInvalidTask     = errors.New("invalid task")
)

// DefaultQueues are the queues a client accepts when none are configured.
var DefaultQueues = []string{"critical", "default", "low"}

// ClientConfig configures a Client.
type ClientConfig struct {
	// Redis is where asynq keeps the queues. Required.
	Redis asynq.RedisConnOpt
	// Pool is the Postgres pool holding the ledger. Required.
	Pool *pgxpool.Pool
	// Queues the client may enqueue to. A task may also go to the queue its
	// own kind names (tasks.Queue in Define): that queue is accepted for
	// that kind's tasks only, not for every task of the program. Anything
	// else is refused, so a typo cannot strand jobs on a queue no worker
	// reads. Default DefaultQueues.
	Queues []string
	// Logger; default slog.Default().
	Logger *slog.Logger
	// TracerProvider records a keel.enqueue span per call and a
	// keel.publish span per job the call publishes. Default: the global
	// provider (otel.GetTracerProvider); while that is the no-op, no span
	// is started. Either way a job enqueued under a valid span keeps that
	// span's trace context and trace id.
	TracerProvider trace.TracerProvider
}

// Client enqueues tasks: durably into the ledger first, then into Redis.
type Client struct {
	store   *jobstore.Store
	pub     *jobstore.Publisher
	queues  map[string]bool
	log     *slog.Logger
	inserts *batch.Batcher[insertReq]
	// rdb is the client's one Redis connection pool: the publisher's and
	// Cancel's inspector's.
	rdb redis.UniversalClient
	// ops is the operator API Cancel and CancelByKey go through.
	ops *inspect.Inspector
	// publishing counts the group-commit rounds still publishing.
	publishing sync.WaitGroup
	tracer     tracing.Tracer
}

// NewClient returns a client. Close it when done.
func NewClient(cfg ClientConfig) (*Client, error) {
	if cfg.Redis == nil {
		return nil, errors.New("keel: tasks.ClientConfig.Redis is required")
	}
	cfg.Redis = redisconn.Follow(cfg.Redis)
	if cfg.Pool == nil {
		return nil, errors.New("keel: tasks.ClientConfig.Pool is required")
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	queues, err := queueSet(cfg.Queues)
	if err != nil {
		return nil, err
	}
	// Every asynq.RedisConnOpt makes a go-redis universal client.
	rdb := cfg.Redis.MakeRedisClient().(redis.UniversalClient)
	c := &Client{
		store:  jobstore.NewStore(cfg.Pool).WithTracerProvider(cfg.TracerProvider),
		pub:    jobstore.NewPublisherOn(rdb),
		queues: queues,
		log:    cfg.Logger,
		rdb:    rdb,
		tracer: tracing.New(cfg.TracerProvider),
	}
	// On the client's Redis connections: closed with them.
	c.ops, err = inspect.New(inspect.Config{Pool: cfg.Pool, Asynq: asynq.NewInspectorFromRedisClient(rdb), RedisClient: rdb})
	if err != nil {
		return nil, err
	}
	c.inserts = batch.NewSettling(insertLoops, maxInsertBatch, ErrClientClosed, c.insertBatch)
	return c, nil
}

// queueSet checks the names of ClientConfig.Queues (nil: DefaultQueues)
// and returns them as a set.
func queueSet(qs []string) (map[string]bool, error) {
	if len(qs) == 0 {
		qs = DefaultQueues
	}
	set := make(map[string]bool, len(qs))
	for _, q := range qs {
		if err := ledger.ValidateQueue(q); err != nil {
			return nil, fmt.Errorf("keel: tasks.ClientConfig.Queues: %w", err)
		}
		set[q] = true
	}
	return set, nil
}

// Close stops the client's group commit and releases its Redis connections.
// Calls made after Close fail with ErrClientClosed.
func (c *Client) Close() error {
	c.inserts.Close()
	c.publishing.Wait()
	return c.rdb.Close()
}

// Inspector is the operator API on the client's ledger and Redis
// (replay, discard, cancel, counts, waiting for a job's end); see the
// inspect package.
func (c *Client) Inspector() *inspect.Inspector { return c.ops }

// Pool is the ledger's pool the client writes to: share it (a scheduler
// does) rather than open another.
func (c *Client) Pool() *pgxpool.Pool { return c.store.Pool() }

// Result is what an enqueue did.
type Result struct {
	// Job is the ledger row: the new one, or the one that already existed.
	Job idempotency.Job
	// Existed is true when (kind, business key) was already in the ledger:
	// nothing new was created and the existing job is returned.
	Existed bool
	// Published is true when the job reached Redis during this call. When it
	// is false the job is still safe: the relay publishes it.
	Published bool
	// PayloadDiffers is true when Existed and the existing job's payload is
	// not the one given: the job keeps its first payload (a key names one
	// business action), and the caller learns that its task was not the
	// one recorded.
	PayloadDiffers bool
}

// Enqueue records t in the ledger and publishes it to Redis. When it returns
// nil the job will run: if Redis could not be reached the relay publishes the
// row later. Enqueueing a (kind, business key) that exists returns the
// existing job with Existed = true, not an error.
//
// Concurrent calls share statements (group commit): calls that arrive while
// another is writing go into the ledger together, in one INSERT and one
// commit, and their jobs go to Redis together, in one script call. A new row
// is written already marked published, so no second commit follows the
// publish; a publish that fails hands the row back to the relay, and should
// the process die in between, the reconciler publishes it after its grace.
func (c *Client) Enqueue(ctx context.Context, t *Task) (*Result, error) {
	ctx, span := c.startEnqueue(ctx, "enqueue", t, 1)
	res, err := c.enqueue(ctx, t, span)
	span.end(res, err)
	return res, err
}

func (c *Client) enqueue(ctx context.Context, t *Task, span enqueueSpan) (*Result, error) {
	nj, err := c.validate(t)
	if err != nil {
		return nil, enqueueError(t, err)
	}
	span.apply(&nj)
	if len(nj.After) > 0 {
		// Its own transaction: its parents are locked until it commits.
		return c.enqueueDependent(ctx, nj)
	}
	if nj.BatchID != "" {
		// Not through the group commit: a sealed batch must fail this
		// call alone, not the round it would share.
		return c.enqueueMember(ctx, nj)
	}
	res, err := c.insert(ctx, nj)
	if err != nil {
		return nil, fmt.Errorf("keel: enqueue %s: %w", t.kind, err)
	}
	return res, nil
}

// EnqueueTx records t inside the caller's transaction: if tx commits the job
// runs (the relay publishes it, woken by a notification sent at commit); if it
// rolls back the job never existed.
func (c *Client) EnqueueTx(ctx context.Context, tx pgx.Tx, t *Task) (*Result, error) {
	ctx, span := c.startEnqueue(ctx, "enqueue", t, 1)
	res, err := c.enqueueTx(ctx, tx, t, span)
	span.end(res, err)
	return res, err
}

func (c *Client) enqueueTx(ctx context.Context, tx pgx.Tx, t *Task, span enqueueSpan) (*Result, error) {
	nj, err := c.validate(t)
	if err != nil {
		return nil, enqueueError(t, err)
	}
	span.apply(&nj)
	nj.WakeRelay = true
	job, existed, err := c.store.Insert(ctx, tx, nj)
	if err != nil {
		return nil, fmt.Errorf("keel: enqueue %s: %w", t.kind, err)
	}
	return newResult(job, existed, nj.Payload), nil
}

// newResult is the Result of one insert of a task with payload.
func newResult(job idempotency.Job, existed bool, payload []byte) *Result {
	return &Result{Job: job, Existed: existed, PayloadDiffers: existed && !bytes.Equal(job.Payload, payload)}
}

// validate checks t as every enqueue does and returns the row to write. Its
// errors name the problem but not the task; the caller adds that.
func (c *Client) validate(t *Task) (jobstore.NewJob, error) {
	if t == nil {
		return jobstore.NewJob{}, fmt.Errorf("%w: nil task", ErrInvalidTask)
	}
	if err := ledger.ValidateKey("kind", t.kind); err != nil {
		return jobstore.NewJob{}, fmt.Errorf("%w: %v", ErrInvalidTask, err)
	}
	if t.err != nil {
		return jobstore.NewJob{}, t.err
	}
	if n := len(t.payload); n > MaxPayloadBytes {
		return jobstore.NewJob{}, fmt.Errorf("%w: %d bytes, limit %d (pass large data by id)", ErrPayloadTooLarge, n, MaxPayloadBytes)
	}
	if err := ledger.ValidateKey("business key", t.s.key); err != nil {
		return jobstore.NewJob{}, fmt.Errorf("%w: %v", ErrInvalidKey, err)
	}
	if err := ledger.ValidateQueue(t.s.queue); err != nil {
		return jobstore.NewJob{}, fmt.Errorf("%w: %v", ErrUnknownQueue, err)
	}
	if q := t.s.queue; !c.queues[q] && q != t.kindQueue {
		return jobstore.NewJob{}, fmt.Errorf("%w %q (known: %v)", ErrUnknownQueue, q, c.queueList(t))
	}
	maxRetry := DefaultMaxRetry
	if t.s.maxRetry != nil {
		maxRetry = *t.s.maxRetry
	}
	if maxRetry < 0 {
		return jobstore.NewJob{}, fmt.Errorf("%w: negative max retry %d", ErrInvalidTask, maxRetry)
	}
	if t.s.timeout < 0 {
		return jobstore.NewJob{}, fmt.Errorf("%w: negative timeout %s", ErrInvalidTask, t.s.timeout)
	}
	if t.s.maxWait < 0 {
		return jobstore.NewJob{}, fmt.Errorf("%w: negative max wait %s", ErrInvalidTask, t.s.maxWait)
	}
	if t.s.unique < 0 {
		return jobstore.NewJob{}, fmt.Errorf("%w: negative unique window %s", ErrInvalidTask, t.s.unique)
	}
	nj := jobstore.NewJob{
		Kind:             t.kind,
		BusinessKey:      t.s.key,
		Queue:            t.s.queue,
		Payload:          t.payload,
		MaxRetry:         maxRetry,
		Timeout:          t.s.timeout,
		MaxWait:          t.s.maxWait,
		Deadline:         t.s.deadline,
		ExpireAtDeadline: t.s.expireStale,
		RunAt:            ceilSecond(t.RunAt(time.Now())),
		PayloadSummary:   t.summary,
		TraceID:          t.s.traceID,
		UniqueWindow:     t.s.unique,
		BatchID:          t.s.batchID,
		After:            t.s.after,
		ConcurrencyKey:   t.ckey,
		ConcurrencyLimit: t.climit,
	}
	// And what the ledger checks (a summary or trace id that is not UTF-8),
	// so that Check refuses all the insert would.
	if err := jobstore.ValidateNewJob(nj); err != nil {
		return jobstore.NewJob{}, fmt.Errorf("%w: %w", ErrInvalidTask, err)
	}
	return nj, nil
}

// enqueueError names the task validate refused.
func enqueueError(t *Task, err error) error {
	if t == nil || t.kind == "" {
		return fmt.Errorf("keel: enqueue: %w", err)
	}
	return fmt.Errorf("keel: enqueue %s: %w", t.kind, err)
}

// ceilSecond rounds t up to a whole second. asynq schedules by Unix seconds,
// truncating, so an unrounded run time would let a delayed job start up to a
// second before its time.
func ceilSecond(t time.Time) time.Time {
	if r := t.Truncate(time.Second); r.Before(t) {
		return r.Add(time.Second)
	}
	return t
}

// queueList names the queues t may go to, for error messages.
func (c *Client) queueList(t *Task) []string {
	var qs []string
	for _, q := range DefaultQueues {
		if c.queues[q] {
			qs = append(qs, q)
		}
	}
	for q := range c.queues {
		if !slices.Contains(DefaultQueues, q) {
			qs = append(qs, q)
		}
	}
	if t.kindQueue != "" && !slices.Contains(qs, t.kindQueue) {
		qs = append(qs, t.kindQueue)
	}
	return qs
}
