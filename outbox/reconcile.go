package outbox

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/keeljobs/keel/idempotency"
)

// Defaults of ReconcilerConfig.
const (
	DefaultReconcileInterval = time.Minute
	DefaultGrace             = 2 * time.Minute
	DefaultReconcileBatch    = 500
	DefaultRetention         = 30 * 24 * time.Hour
	DefaultPruneBatch        = 1000
)

// ReconcilerConfig configures a Reconciler.
type ReconcilerConfig struct {
	// Interval between passes. Default 1m.
	Interval time.Duration
	// Grace is how long a job must have been left alone before its absence
	// from Redis counts as lost; it covers jobs in flight between the two
	// stores. Default 2m.
	Grace time.Duration
	// BatchSize is how many ledger rows one query reads. Default 500.
	BatchSize int
	// Retention is how long succeeded and discarded jobs are kept. It is
	// also the dedupe window of a business key: after it, the same key makes
	// a new job. Dead jobs are never pruned. Default 30 days; negative
	// disables pruning.
	Retention time.Duration
	// PruneBatch is how many rows one delete removes. Default 1000.
	PruneBatch int
	// Logger; default slog.Default().
	Logger *slog.Logger
}

func (c ReconcilerConfig) withDefaults() ReconcilerConfig {
	if c.Interval <= 0 {
		c.Interval = DefaultReconcileInterval
	}
	if c.Grace <= 0 {
		c.Grace = DefaultGrace
	}
	if c.BatchSize <= 0 {
		c.BatchSize = DefaultReconcileBatch
	}
	if c.Retention == 0 {
		c.Retention = DefaultRetention
	}
	if c.PruneBatch <= 0 {
		c.PruneBatch = DefaultPruneBatch
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

// Reconciler makes Redis agree with the ledger again when they drift: jobs
// the ledger says should run but Redis no longer holds (a restart without
// persistence, FLUSHALL, a failover that lost writes) are published again;
// leases of workers that are gone are released; finished jobs past their
// retention are pruned. It never touches succeeded, discarded or dead jobs'
// state, and publishes with the ledger id, so a job Redis still holds is
// never doubled. Any number can run: a pass takes an advisory lock and
// others skip it.
type Reconciler struct {
	pool  *pgxpool.Pool
	store *idempotency.Store
	insp  *asynq.Inspector
	pub   *asynq.Client
	rdb   redis.UniversalClient
	cfg   ReconcilerConfig

	repaired, released, pruned atomic.Uint64
}

// NewReconciler returns a reconciler; Run it, then Close it.
func NewReconciler(pool *pgxpool.Pool, redisOpt asynq.RedisConnOpt, cfg ReconcilerConfig) *Reconciler {
	return &Reconciler{pool: pool, store: idempotency.NewStore(pool), insp: asynq.NewInspector(redisOpt),
		pub: asynq.NewClient(redisOpt), rdb: redisOpt.MakeRedisClient().(redis.UniversalClient), cfg: cfg.withDefaults()}
}

// asynqQueuesKey is asynq's registry of queue names (asynq v0.26's
// base.AllQueues).
const asynqQueuesKey = "asynq:queues"

// Close releases Redis connections.
func (r *Reconciler) Close() error { return errors.Join(r.insp.Close(), r.pub.Close(), r.rdb.Close()) }

// ReconcileStats counts what reconcilers did.
type ReconcileStats struct {
	Republished, LeasesReleased, Pruned uint64
}

// Stats returns this reconciler's counters.
func (r *Reconciler) Stats() ReconcileStats {
	return ReconcileStats{Republished: r.repaired.Load(), LeasesReleased: r.released.Load(), Pruned: r.pruned.Load()}
}

// Run reconciles and prunes every Interval until ctx ends.
func (r *Reconciler) Run(ctx context.Context) error {
	t := time.NewTicker(r.cfg.Interval)
	defer t.Stop()
	for {
		if _, err := r.Reconcile(ctx); err != nil && ctx.Err() == nil {
			r.cfg.Logger.Warn("keel reconciler: pass failed", "err", err)
		}
		if r.cfg.Retention > 0 {
			if _, err := r.Prune(ctx); err != nil && ctx.Err() == nil {
				r.cfg.Logger.Warn("keel reconciler: prune failed", "err", err)
			}
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

const (
	reconcileLock      = 736543490
	reconcileLockSQL   = `SELECT pg_try_advisory_lock($1::int4, hashtext(current_schema()))`
	reconcileUnlockSQL = `SELECT pg_advisory_unlock($1::int4, hashtext(current_schema()))`
)

// Reconcile runs one full pass over the open jobs and returns how many it
// published again. It returns 0 without work when another pass holds the lock.
func (r *Reconciler) Reconcile(ctx context.Context) (int, error) {
	conn, err := r.pool.Acquire(ctx)
	if err != nil {
		return 0, err
	}
	defer conn.Release()
	var got bool
	// One lock per ledger: keyed by schema, so ledgers in other schemas of
	// the same database do not wait for each other.
	if err := conn.QueryRow(ctx, reconcileLockSQL, reconcileLock).Scan(&got); err != nil || !got {
		return 0, err
	}
	defer conn.Exec(context.WithoutCancel(ctx), reconcileUnlockSQL, reconcileLock) //nolint:errcheck // dropped with the session anyway

	released, err := r.releaseExpiredLeases(ctx)
	if err != nil {
		return 0, err
	}
	r.released.Add(uint64(released))

	repaired := 0
	cursor := ""
	for {
		// Keyset pagination over the partial index keeps each query cheap
		// however large the ledger grows.
		rows, err := r.pool.Query(ctx, `SELECT id FROM keel_jobs
			WHERE status IN ('pending', 'running', 'failed') AND published_at IS NOT NULL
			  AND updated_at < now() - $1 * interval '1 millisecond' AND id > $2
			ORDER BY id LIMIT $3`, r.cfg.Grace.Milliseconds(), cursor, r.cfg.BatchSize)
		if err != nil {
			return repaired, err
		}
		ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			return repaired, err
		}
		if len(ids) == 0 {
			break
		}
		cursor = ids[len(ids)-1]
		jobs, err := r.store.GetMany(ctx, r.pool, ids)
		if err != nil {
			return repaired, err
		}
		for _, j := range jobs {
			if j.Status == idempotency.StatusRunning && j.LeaseUntil != nil && j.LeaseUntil.After(time.Now()) {
				continue // a live worker holds it
			}
			lost, err := r.missing(j)
			if err != nil {
				return repaired, err
			}
			if !lost {
				continue
			}
			if j.Status == idempotency.StatusFailed {
				j.RunAt = time.Now() // its retry time was in the lost Redis entry
			}
			created, err := r.store.PublishNew(ctx, r.pub, j)
			if err != nil {
				return repaired, err
			}
			if !created {
				continue // Redis held it after all (asynq no longer lists its queue, say)
			}
			repaired++
			r.cfg.Logger.Warn("keel reconciler: job missing from Redis, published again", "job_id", j.ID, "kind", j.Kind, "status", j.Status)
		}
		if len(ids) < r.cfg.BatchSize {
			break
		}
	}
	r.repaired.Add(uint64(repaired))
	return repaired, nil
}

// missing reports whether Redis holds no live task for j. An archived task
// of a job the ledger says should still run (its failure was never
// recorded, or another deployment's worker refused it) is drift too: it is
// removed so the job can be published again.
func (r *Reconciler) missing(j idempotency.Job) (bool, error) {
	info, err := r.insp.GetTaskInfo(j.Queue, j.ID)
	switch {
	case err == nil && info.State == asynq.TaskStateArchived:
		if err := r.insp.DeleteTask(j.Queue, j.ID); err != nil && !errors.Is(err, asynq.ErrTaskNotFound) {
			return false, fmt.Errorf("keel reconciler: remove archived copy of open job %s: %w", j.ID, err)
		}
		return true, nil
	case err == nil:
		return false, nil
	case errors.Is(err, asynq.ErrQueueNotFound):
		// asynq lists a queue in its registry only on a client's first
		// enqueue, so after Redis lost everything long-lived clients refill
		// queues nobody lists, and asynqmon, the inspector and the metrics
		// cannot see them. Listing it again is what any first enqueue does.
		if err := r.rdb.SAdd(context.Background(), asynqQueuesKey, j.Queue).Err(); err != nil {
			return false, fmt.Errorf("keel reconciler: list queue %q: %w", j.Queue, err)
		}
		return true, nil
	case errors.Is(err, asynq.ErrTaskNotFound):
		return true, nil
	}
	return false, fmt.Errorf("keel reconciler: look up job %s in Redis: %w", j.ID, err)
}

// releaseExpiredLeases hands jobs whose worker is gone back to pending, so
// the ledger no longer names a dead holder; the next delivery claims them.
func (r *Reconciler) releaseExpiredLeases(ctx context.Context) (int, error) {
	// Class "wait": not the job's own failure, and forgotten when it succeeds.
	tag, err := r.pool.Exec(ctx, `UPDATE keel_jobs SET status = 'pending', lease_holder = NULL, lease_until = NULL,
		last_error = coalesce(last_error || E'\n', '') || 'lease of ' || lease_holder || ' expired: worker gone',
		error_class = 'wait',
		updated_at = now()
		WHERE status = 'running' AND lease_until < now() - $1 * interval '1 millisecond'`, r.cfg.Grace.Milliseconds())
	if err != nil {
		return 0, err
	}
	return int(tag.RowsAffected()), nil
}

// Prune deletes succeeded and discarded jobs (and their steps) finished
// longer than Retention ago, in small batches so it never holds long locks.
// Dead jobs are kept until a person closes them.
func (r *Reconciler) Prune(ctx context.Context) (int, error) {
	if r.cfg.Retention <= 0 {
		return 0, nil
	}
	total := 0
	for {
		tag, err := r.pool.Exec(ctx, pruneSQL, r.cfg.Retention.Milliseconds(), r.cfg.PruneBatch)
		if err != nil {
			return total, err
		}
		n := int(tag.RowsAffected())
		total += n
		if n < r.cfg.PruneBatch || ctx.Err() != nil {
			break
		}
	}
	if total > 0 {
		r.pruned.Add(uint64(total))
		if _, err := r.pool.Exec(ctx, `INSERT INTO keel_prune_log (rows) VALUES ($1)`, total); err != nil {
			return total, err
		}
		if _, err := r.pool.Exec(ctx, `DELETE FROM keel_prune_log WHERE at < now() - interval '7 days'`); err != nil {
			return total, err
		}
	}
	return total, nil
}

// pruneSQL stays on keel_jobs_prunable: see TestPruneUsesIndex.
// ANY(ARRAY(…)) makes the delete probe the primary key per row; with IN
// (subquery) the planner hashes the batch and scans the whole table.
const pruneSQL = `DELETE FROM keel_jobs WHERE id = ANY (ARRAY (
	SELECT id FROM keel_jobs
	WHERE status IN ('succeeded', 'discarded') AND finished_at < now() - $1 * interval '1 millisecond'
	ORDER BY finished_at LIMIT $2 FOR UPDATE SKIP LOCKED))`

// PruneSQL is the statement Prune runs, exported for plan inspection.
func PruneSQL() string { return pruneSQL }
