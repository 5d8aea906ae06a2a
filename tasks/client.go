package tasks

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/keeljobs/keel/idempotency"
)

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
	// Queues the client may enqueue to, besides the queues declared kinds
	// name (tasks.Queue in Define); anything else is refused, so a typo
	// cannot strand jobs on a queue no worker reads. Default DefaultQueues.
	Queues []string
	// Logger; default slog.Default().
	Logger *slog.Logger
}

// Client enqueues tasks: durably into the ledger first, then into Redis.
type Client struct {
	store  *idempotency.Store
	asynq  *asynq.Client
	queues map[string]bool
	log    *slog.Logger
}

// NewClient returns a client. Close it when done.
func NewClient(cfg ClientConfig) (*Client, error) {
	if cfg.Redis == nil {
		return nil, errors.New("keel: tasks.ClientConfig.Redis is required")
	}
	if cfg.Pool == nil {
		return nil, errors.New("keel: tasks.ClientConfig.Pool is required")
	}
	if len(cfg.Queues) == 0 {
		cfg.Queues = DefaultQueues
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	c := &Client{
		store:  idempotency.NewStore(cfg.Pool),
		asynq:  asynq.NewClient(cfg.Redis),
		queues: map[string]bool{},
		log:    cfg.Logger,
	}
	for _, q := range cfg.Queues {
		c.queues[q] = true
	}
	return c, nil
}

// Close releases the client's Redis connections.
func (c *Client) Close() error { return c.asynq.Close() }

// Store is the ledger the client writes to.
func (c *Client) Store() *idempotency.Store { return c.store }

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
}

// Enqueue records t in the ledger and publishes it to Redis. When it returns
// nil the job will run: if Redis could not be reached the relay publishes the
// row later. Enqueueing a (kind, business key) that exists returns the
// existing job with Existed = true, not an error.
func (c *Client) Enqueue(ctx context.Context, t *Task) (*Result, error) {
	nj, err := c.validate(t)
	if err != nil {
		return nil, err
	}
	job, existed, err := c.store.Insert(ctx, c.store.Pool(), nj)
	if err != nil {
		return nil, fmt.Errorf("keel: enqueue %s: %w", t.kind, err)
	}
	res := &Result{Job: job, Existed: existed}
	if existed && job.PublishedAt != nil {
		return res, nil
	}
	if job.Status != idempotency.StatusPending || job.PublishedAt != nil {
		return res, nil
	}
	if err := c.store.Publish(ctx, c.asynq, job); err != nil {
		// Durable already; the relay retries the publish.
		c.log.Warn("keel: publish deferred to the relay", "job_id", job.ID, "kind", job.Kind, "err", err)
		return res, nil
	}
	res.Published = true
	return res, nil
}

// EnqueueTx records t inside the caller's transaction: if tx commits the job
// runs (the relay publishes it, woken by a notification sent at commit); if it
// rolls back the job never existed.
func (c *Client) EnqueueTx(ctx context.Context, tx pgx.Tx, t *Task) (*Result, error) {
	nj, err := c.validate(t)
	if err != nil {
		return nil, err
	}
	nj.WakeRelay = true
	job, existed, err := c.store.Insert(ctx, tx, nj)
	if err != nil {
		return nil, fmt.Errorf("keel: enqueue %s: %w", t.kind, err)
	}
	return &Result{Job: job, Existed: existed}, nil
}

func (c *Client) validate(t *Task) (idempotency.NewJob, error) {
	if t == nil {
		return idempotency.NewJob{}, fmt.Errorf("keel: enqueue: %w: nil task", ErrInvalidTask)
	}
	if t.err != nil {
		return idempotency.NewJob{}, fmt.Errorf("keel: enqueue %s: %w: payload does not encode: %v", t.kind, ErrInvalidTask, t.err)
	}
	if err := idempotency.ValidateKey("kind", t.kind); err != nil {
		return idempotency.NewJob{}, fmt.Errorf("keel: enqueue: %w: %v", ErrInvalidTask, err)
	}
	if n := len(t.payload); n > MaxPayloadBytes {
		return idempotency.NewJob{}, fmt.Errorf("keel: enqueue %s: %w: %d bytes, limit %d (pass large data by id)",
			t.kind, ErrPayloadTooLarge, n, MaxPayloadBytes)
	}
	if err := idempotency.ValidateKey("business key", t.s.key); err != nil {
		return idempotency.NewJob{}, fmt.Errorf("keel: enqueue %s: %w: %v", t.kind, ErrInvalidKey, err)
	}
	if strings.TrimSpace(t.s.queue) == "" || (!c.queues[t.s.queue] && !declaredQueue(t.s.queue)) {
		return idempotency.NewJob{}, fmt.Errorf("keel: enqueue %s: %w %q (known: %v)", t.kind, ErrUnknownQueue, t.s.queue, c.queueList())
	}
	maxRetry := DefaultMaxRetry
	if t.s.maxRetry != nil {
		maxRetry = *t.s.maxRetry
	}
	if maxRetry < 0 {
		return idempotency.NewJob{}, fmt.Errorf("keel: enqueue %s: %w: negative max retry %d", t.kind, ErrInvalidTask, maxRetry)
	}
	if t.s.timeout < 0 {
		return idempotency.NewJob{}, fmt.Errorf("keel: enqueue %s: %w: negative timeout %s", t.kind, ErrInvalidTask, t.s.timeout)
	}
	if t.s.maxWait < 0 {
		return idempotency.NewJob{}, fmt.Errorf("keel: enqueue %s: %w: negative max wait %s", t.kind, ErrInvalidTask, t.s.maxWait)
	}
	return idempotency.NewJob{
		Kind:           t.kind,
		BusinessKey:    t.s.key,
		Queue:          t.s.queue,
		Payload:        t.payload,
		MaxRetry:       maxRetry,
		Timeout:        t.s.timeout,
		MaxWait:        t.s.maxWait,
		Deadline:       t.s.deadline,
		RunAt:          ceilSecond(t.RunAt(time.Now())),
		PayloadSummary: t.summary,
		TraceID:        t.s.traceID,
	}, nil
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

func (c *Client) queueList() []string {
	var qs []string
	for _, q := range DefaultQueues {
		if c.queues[q] {
			qs = append(qs, q)
		}
	}
	for q := range c.queues {
		if !contains(DefaultQueues, q) {
			qs = append(qs, q)
		}
	}
	return qs
}

func contains(xs []string, x string) bool {
	for _, y := range xs {
		if x == y {
			return true
		}
	}
	return false
}
