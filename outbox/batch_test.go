package outbox_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/testenv"
	"github.com/keeljobs/keel/server"
	"github.com/keeljobs/keel/tasks"
)

var flushedBatchDone = tasks.DefineBatchDone("outbox:batch_done")

// Redis is flushed in the middle of a batch: the reconciler republishes the
// members it lost, and the batch's callback is still enqueued and run once.
func TestBatchCallbackFiresOnceAfterRedisIsFlushed(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	_, err := b.pool.Exec(ctx, `CREATE TABLE callback_runs (batch_id text, generation int, total int)`)
	require.NoError(t, err)
	c := b.client(t, b.opt)

	mux := tasks.NewMux()
	// The first three members run at once; the others wait for the gate,
	// so Redis still holds them, pending or active, when it is flushed.
	gate := make(chan struct{})
	tasks.Handle(mux, work, func(ctx context.Context, it item) error {
		if it.ID >= "m03" {
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-gate:
			}
		}
		return idempotency.InTx(ctx, func(tx pgx.Tx) error {
			id, _ := idempotency.JobID(ctx)
			_, err := tx.Exec(ctx, `INSERT INTO effects (item, job_id) VALUES ($1, $2)`, it.ID, id)
			return err
		})
	})
	tasks.Handle(mux, flushedBatchDone, func(ctx context.Context, d tasks.BatchDone) error {
		return idempotency.InTx(ctx, func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `INSERT INTO callback_runs VALUES ($1, $2, $3)`, d.BatchID, d.Generation, d.Counts.Total)
			return err
		})
	})

	batch, err := c.NewBatch(ctx, tasks.BatchSpec{OnComplete: tasks.BatchCallback(flushedBatchDone, nil)})
	require.NoError(t, err)
	const n = 12
	ts := make([]*tasks.Task, n)
	for i := range ts {
		ts[i] = work.New(item{ID: fmt.Sprintf("m%02d", i)}, tasks.InBatch(batch.ID))
	}
	_, err = c.EnqueueMany(ctx, ts...)
	require.NoError(t, err)
	_, err = c.SealBatch(ctx, batch.ID)
	require.NoError(t, err)

	b.worker(t, mux, func(cfg *server.Config) { cfg.Concurrency = 4 })
	testenv.Eventually(t, 20*time.Second, func() bool {
		return b.count(t, `SELECT count(*) FROM effects`) == 3
	}, "the first members never ran")
	rc := redis.NewClient(&redis.Options{Addr: b.redis.Addr()})
	defer rc.Close()
	require.NoError(t, rc.FlushAll(ctx).Err())
	close(gate)

	testenv.Eventually(t, 60*time.Second, func() bool {
		return b.count(t, `SELECT count(*) FROM callback_runs`) > 0
	}, "the batch's callback never ran")
	require.Equal(t, n, b.count(t, `SELECT count(DISTINCT item) FROM effects`))
	require.Equal(t, n, b.count(t, `SELECT count(*) FROM effects`), "a member's effect happened twice")
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM callback_runs WHERE batch_id = $1 AND generation = 1 AND total = $2`, batch.ID, n))
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM keel_jobs WHERE kind = $1`, flushedBatchDone.Name()))
}
