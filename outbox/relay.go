package outbox

import (
	"context"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/keeljobs/keel/idempotency"
)

// Defaults of RelayConfig.
const (
	DefaultPollInterval = time.Second
	DefaultBatchSize    = 200
)

// RelayConfig configures a Relay.
type RelayConfig struct {
	// PollInterval is how often the relay looks for unpublished rows when no
	// notification wakes it. Default 1s.
	PollInterval time.Duration
	// BatchSize is how many rows one pass claims. Default 200.
	BatchSize int
	// Logger; default slog.Default().
	Logger *slog.Logger
}

func (c RelayConfig) withDefaults() RelayConfig {
	if c.PollInterval <= 0 {
		c.PollInterval = DefaultPollInterval
	}
	if c.BatchSize <= 0 {
		c.BatchSize = DefaultBatchSize
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

// Relay publishes ledger rows that are committed but not yet in Redis:
// written by EnqueueTx, by Enqueue while Redis was down, or handed back by
// a worker. Any number of relays can run at once: rows are claimed with
// FOR UPDATE SKIP LOCKED, and the ledger id is the asynq task id, so a
// publish repeated after a crash is a harmless conflict.
type Relay struct {
	pool  *pgxpool.Pool
	store *idempotency.Store
	asynq *asynq.Client
	cfg   RelayConfig

	published atomic.Uint64
}

// NewRelay returns a relay; Run it, then Close it.
func NewRelay(pool *pgxpool.Pool, redis asynq.RedisConnOpt, cfg RelayConfig) *Relay {
	return &Relay{pool: pool, store: idempotency.NewStore(pool), asynq: asynq.NewClient(redis), cfg: cfg.withDefaults()}
}

// Close releases the relay's Redis connections.
func (r *Relay) Close() error { return r.asynq.Close() }

// Published is how many jobs this relay has published.
func (r *Relay) Published() uint64 { return r.published.Load() }

// Run publishes until ctx ends. It wakes on the ledger's notification and
// polls as a fallback, so a lost notification delays a job by at most one
// poll interval.
func (r *Relay) Run(ctx context.Context) error {
	wake := make(chan struct{}, 1)
	go r.listen(ctx, wake)
	t := time.NewTicker(r.cfg.PollInterval)
	defer t.Stop()
	for {
		for {
			n, err := r.PublishBatch(ctx)
			if err != nil {
				if ctx.Err() != nil {
					return nil
				}
				r.cfg.Logger.Warn("keel relay: publish pass failed", "err", err)
				break
			}
			if n < r.cfg.BatchSize {
				break
			}
		}
		select {
		case <-ctx.Done():
			return nil
		case <-wake:
		case <-t.C:
		}
	}
}

// listen turns ledger notifications into wake-ups, reconnecting after errors.
func (r *Relay) listen(ctx context.Context, wake chan<- struct{}) {
	for ctx.Err() == nil {
		err := r.listenOnce(ctx, wake)
		if ctx.Err() != nil {
			return
		}
		r.cfg.Logger.Debug("keel relay: listen connection lost", "err", err)
		select {
		case <-ctx.Done():
			return
		case <-time.After(r.cfg.PollInterval):
		}
	}
}

func (r *Relay) listenOnce(ctx context.Context, wake chan<- struct{}) error {
	pc, err := r.pool.Acquire(ctx)
	if err != nil {
		return err
	}
	// A LISTENing connection must not go back to the pool.
	conn := pc.Hijack()
	defer conn.Close(context.Background())
	if _, err := conn.Exec(ctx, "LISTEN "+idempotency.RelayChannel); err != nil {
		return err
	}
	for {
		if _, err := conn.WaitForNotification(ctx); err != nil {
			return err
		}
		select {
		case wake <- struct{}{}:
		default:
		}
	}
}

// PublishBatch publishes one batch of unpublished rows and returns how many
// it published.
func (r *Relay) PublishBatch(ctx context.Context) (int, error) {
	jobs, err := r.store.ClaimUnpublished(ctx, r.cfg.BatchSize)
	if err != nil {
		return 0, fmt.Errorf("keel relay: %w", err)
	}
	res, _ := r.store.PublishMany(ctx, r.asynq, jobs) // claimed rows are marked already
	n := 0
	var pubErr error
	var failed []string
	for i, p := range res {
		if p.Err == nil {
			n++
			continue
		}
		pubErr = p.Err
		failed = append(failed, jobs[i].ID)
		// One job Redis refuses must not hold up the rest of the batch.
		if len(failed) <= 3 {
			r.cfg.Logger.Warn("keel relay: could not publish job", "job_id", jobs[i].ID, "kind", jobs[i].Kind, "err", p.Err)
		}
	}
	if len(failed) > 0 {
		ids := failed
		// Without the ledger the reconciler republishes them after its grace.
		if err := r.store.Unpublish(context.WithoutCancel(ctx), ids); err != nil {
			r.cfg.Logger.Warn("keel relay: could not hand back unpublished jobs", "jobs", len(ids), "err", err)
		}
	}
	r.published.Add(uint64(n))
	if pubErr != nil && n == 0 {
		return 0, fmt.Errorf("keel relay: %w", pubErr)
	}
	return n, nil
}
