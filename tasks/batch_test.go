package tasks_test

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/jobstore"
	"github.com/keeljobs/keel/internal/testworker"
	"github.com/keeljobs/keel/tasks"
)

var batchDone = tasks.DefineBatchDone("test:batch_done")

type runInfo struct {
	Run string `json:"run"`
}

// callbacks returns the batch's callback jobs, decoded, in generation order.
func (b *bundle) callbacks(t *testing.T, batchID string) []tasks.BatchDone {
	t.Helper()
	rows, err := b.pool.Query(context.Background(), `SELECT payload FROM keel_jobs
		WHERE business_key LIKE 'batch:' || $1 || ':%' ORDER BY id`, batchID)
	require.NoError(t, err)
	defer rows.Close()
	var out []tasks.BatchDone
	for rows.Next() {
		var p []byte
		require.NoError(t, rows.Scan(&p))
		d, err := batchDone.Decode(p)
		require.NoError(t, err)
		out = append(out, d)
	}
	require.NoError(t, rows.Err())
	return out
}

// end moves a job to a status the way the ledger's own statements do,
// by an UPDATE of its status: the batch triggers react to any of them.
func (b *bundle) end(t *testing.T, id string, status idempotency.Status) {
	t.Helper()
	_, err := b.pool.Exec(context.Background(), `UPDATE keel_jobs SET status = $2, finished_at = now() WHERE id = $1`, id, status)
	require.NoError(t, err)
}

func TestBatchCallbackWaitsForTheSealAndEveryMember(t *testing.T) {
	b := setup(t)
	ctx := context.Background()

	batch, err := b.client.NewBatch(ctx, tasks.BatchSpec{Description: "billing run 7",
		OnComplete: tasks.BatchCallback(batchDone, runInfo{Run: "7"}),
		OnSuccess:  tasks.BatchCallback(batchDone, runInfo{Run: "7"}, tasks.Queue("critical"))})
	require.NoError(t, err)
	require.Equal(t, "open", batch.State())

	var ids []string
	for i := range 3 {
		r, err := b.client.Enqueue(ctx, keyedKind.New(keyed{Key: fmt.Sprintf("m%d", i)}, tasks.InBatch(batch.ID)))
		require.NoError(t, err)
		require.False(t, r.Existed)
		require.True(t, r.Published)
		require.Equal(t, batch.ID, r.Job.BatchID)
		ids = append(ids, r.Job.ID)
	}
	b.end(t, ids[0], idempotency.StatusSucceeded)
	b.end(t, ids[1], idempotency.StatusSucceeded)
	b.end(t, ids[2], idempotency.StatusDead)
	require.Empty(t, b.callbacks(t, batch.ID), "an unsealed batch does not complete")

	batch, err = b.client.SealBatch(ctx, batch.ID)
	require.NoError(t, err)
	require.Equal(t, "complete", batch.State())
	require.Equal(t, 1, batch.Generation)
	require.Equal(t, 3, batch.Total)
	require.Equal(t, 2, batch.Succeeded)
	require.Equal(t, 1, batch.Dead)
	require.NotEmpty(t, batch.CompleteJobID)
	require.Empty(t, batch.SuccessJobID, "a member died: no on_success")

	cbs := b.callbacks(t, batch.ID)
	require.Len(t, cbs, 1)
	require.Equal(t, tasks.BatchDone{BatchID: batch.ID, Generation: 1, Event: tasks.BatchComplete, Description: "billing run 7",
		Counts: tasks.BatchCounts{Total: 3, Succeeded: 2, Dead: 1}, Data: json.RawMessage(`{"run": "7"}`)}, cbs[0])
	cb, err := b.store.Get(ctx, batch.CompleteJobID)
	require.NoError(t, err)
	require.Equal(t, batchDone.Name(), cb.Kind)
	require.Equal(t, jobstore.CallbackKey(batch.ID, "complete", 1), cb.BusinessKey)
	require.Empty(t, cb.BatchID, "a callback is not a member")
	require.Nil(t, cb.PublishedAt, "the relay publishes the callback")

	_, err = b.client.Enqueue(ctx, keyedKind.New(keyed{Key: "late"}, tasks.InBatch(batch.ID)))
	require.ErrorIs(t, err, tasks.ErrBatchSealed)
	_, err = b.client.EnqueueMany(ctx, keyedKind.New(keyed{Key: "late"}, tasks.InBatch(batch.ID)))
	require.ErrorIs(t, err, tasks.ErrBatchSealed)
	require.Equal(t, 0, b.count(t, `SELECT count(*) FROM keel_jobs WHERE business_key = 'late'`))

	again, err := b.client.SealBatch(ctx, batch.ID)
	require.NoError(t, err)
	require.Equal(t, batch.Generation, again.Generation, "sealing again changes nothing")
	require.Len(t, b.callbacks(t, batch.ID), 1)
}

func TestBatchOnSuccessWhenEveryMemberSucceeded(t *testing.T) {
	b := setup(t)
	ctx := context.Background()

	batch, err := b.client.NewBatch(ctx, tasks.BatchSpec{OnSuccess: tasks.BatchCallback(batchDone, nil)})
	require.NoError(t, err)
	res, err := b.client.EnqueueMany(ctx, keyedKind.New(keyed{Key: "s1"}, tasks.InBatch(batch.ID)),
		keyedKind.New(keyed{Key: "s2"}, tasks.InBatch(batch.ID)))
	require.NoError(t, err)
	_, err = b.client.SealBatch(ctx, batch.ID)
	require.NoError(t, err)
	b.end(t, res[0].Job.ID, idempotency.StatusSucceeded)
	require.Empty(t, b.callbacks(t, batch.ID))
	b.end(t, res[1].Job.ID, idempotency.StatusSucceeded)

	cbs := b.callbacks(t, batch.ID)
	require.Len(t, cbs, 1)
	require.Equal(t, tasks.BatchSuccess, cbs[0].Event)
	require.Equal(t, tasks.BatchCounts{Total: 2, Succeeded: 2}, cbs[0].Counts)
	require.JSONEq(t, `null`, string(cbs[0].Data))
}

func TestSealingAnEmptyOrEndedBatchFiresAtOnce(t *testing.T) {
	b := setup(t)
	ctx := context.Background()

	empty, err := b.client.NewBatch(ctx, tasks.BatchSpec{OnComplete: tasks.BatchCallback(batchDone, nil)})
	require.NoError(t, err)
	empty, err = b.client.SealBatch(ctx, empty.ID)
	require.NoError(t, err)
	require.Equal(t, "complete", empty.State())
	require.Equal(t, []tasks.BatchCounts{{}}, countsOf(b.callbacks(t, empty.ID)))

	ended, err := b.client.NewBatch(ctx, tasks.BatchSpec{OnComplete: tasks.BatchCallback(batchDone, nil)})
	require.NoError(t, err)
	r, err := b.client.Enqueue(ctx, keyedKind.New(keyed{Key: "e1"}, tasks.InBatch(ended.ID)))
	require.NoError(t, err)
	b.end(t, r.Job.ID, idempotency.StatusCancelled)
	ended, err = b.client.SealBatch(ctx, ended.ID)
	require.NoError(t, err)
	require.Equal(t, "complete", ended.State())
	require.Equal(t, []tasks.BatchCounts{{Total: 1, Cancelled: 1}}, countsOf(b.callbacks(t, ended.ID)))
}

func countsOf(ds []tasks.BatchDone) []tasks.BatchCounts {
	var out []tasks.BatchCounts
	for _, d := range ds {
		out = append(out, d.Counts)
	}
	return out
}

// A task whose key is in the ledger already is the existing job: it does
// not join the batch and the batch does not wait for it.
func TestBatchMemberWithAnExistingKeyIsNotAdded(t *testing.T) {
	b := setup(t)
	ctx := context.Background()

	old, err := b.client.Enqueue(ctx, keyedKind.New(keyed{Key: "dup"}))
	require.NoError(t, err)
	batch, err := b.client.NewBatch(ctx, tasks.BatchSpec{OnComplete: tasks.BatchCallback(batchDone, nil)})
	require.NoError(t, err)
	r, err := b.client.Enqueue(ctx, keyedKind.New(keyed{Key: "dup"}, tasks.InBatch(batch.ID)))
	require.NoError(t, err)
	require.True(t, r.Existed)
	require.Equal(t, old.Job.ID, r.Job.ID)
	require.Empty(t, r.Job.BatchID, "the existing job says it is in no batch")
	batch, err = b.client.SealBatch(ctx, batch.ID)
	require.NoError(t, err)
	require.Equal(t, 0, batch.Total)
	require.Equal(t, "complete", batch.State())
}

func TestBatchRefusesBadInput(t *testing.T) {
	b := setup(t)
	ctx := context.Background()

	_, err := b.client.Enqueue(ctx, keyedKind.New(keyed{Key: "x"}, tasks.InBatch("no-such-batch")))
	require.ErrorIs(t, err, tasks.ErrBatchNotFound)
	_, err = b.client.SealBatch(ctx, "no-such-batch")
	require.ErrorIs(t, err, tasks.ErrBatchNotFound)
	_, err = b.client.SealBatch(ctx, "")
	require.ErrorIs(t, err, tasks.ErrBatchNotFound)

	_, err = b.client.NewBatch(ctx, tasks.BatchSpec{OnComplete: tasks.BatchCallback(batchDone, nil, tasks.Queue("nowhere"))})
	require.ErrorIs(t, err, tasks.ErrUnknownQueue)
	_, err = b.client.NewBatch(ctx, tasks.BatchSpec{OnComplete: tasks.BatchCallback(batchDone, func() {})})
	require.ErrorIs(t, err, tasks.ErrInvalidTask)
	_, err = b.client.NewBatch(ctx, tasks.BatchSpec{OnComplete: tasks.NewRaw("test:batch_done", []byte("not json"), "")})
	require.ErrorIs(t, err, tasks.ErrInvalidTask)
	_, err = b.client.NewBatch(ctx, tasks.BatchSpec{OnComplete: tasks.BatchCallback(batchDone, nil, tasks.InBatch("x"))})
	require.ErrorIs(t, err, tasks.ErrInvalidTask)
	require.Equal(t, 0, b.count(t, `SELECT count(*) FROM keel_batches`))
}

// The batch and its first members commit with the caller's transaction, or
// not at all.
func TestNewBatchTxFollowsTheTransaction(t *testing.T) {
	b := setup(t)
	ctx := context.Background()

	tx, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	batch, err := b.client.NewBatchTx(ctx, tx, tasks.BatchSpec{Description: "rolled back"})
	require.NoError(t, err)
	_, err = b.client.EnqueueTx(ctx, tx, keyedKind.New(keyed{Key: "rb"}, tasks.InBatch(batch.ID)))
	require.NoError(t, err)
	require.NoError(t, tx.Rollback(ctx))
	require.Equal(t, 0, b.count(t, `SELECT count(*) FROM keel_batches`))
	require.Equal(t, 0, b.count(t, `SELECT count(*) FROM keel_jobs`))

	tx, err = b.pool.Begin(ctx)
	require.NoError(t, err)
	batch, err = b.client.NewBatchTx(ctx, tx, tasks.BatchSpec{Description: "committed"})
	require.NoError(t, err)
	_, err = b.client.EnqueueTx(ctx, tx, keyedKind.New(keyed{Key: "c1"}, tasks.InBatch(batch.ID)))
	require.NoError(t, err)
	_, err = b.client.EnqueueManyTx(ctx, tx, keyedKind.New(keyed{Key: "c2"}, tasks.InBatch(batch.ID)),
		keyedKind.New(keyed{Key: "c3"}, tasks.InBatch(batch.ID)))
	require.NoError(t, err)
	_, err = b.client.SealBatchTx(ctx, tx, batch.ID)
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	got, err := b.store.GetBatch(ctx, batch.ID)
	require.NoError(t, err)
	require.Equal(t, 3, got.Total)
	require.Equal(t, "sealed", got.State())
}

// A member moving between terminal statuses (a dead one discarded, a
// succeeded one marked dead) moves the counters and fires nothing again.
func TestBatchCountsMoveBetweenTerminalStatusesWithoutFiring(t *testing.T) {
	b := setup(t)
	ctx := context.Background()

	batch, err := b.client.NewBatch(ctx, tasks.BatchSpec{OnComplete: tasks.BatchCallback(batchDone, nil)})
	require.NoError(t, err)
	res, err := b.client.EnqueueMany(ctx, keyedKind.New(keyed{Key: "t1"}, tasks.InBatch(batch.ID)),
		keyedKind.New(keyed{Key: "t2"}, tasks.InBatch(batch.ID)))
	require.NoError(t, err)
	_, err = b.client.SealBatch(ctx, batch.ID)
	require.NoError(t, err)
	b.end(t, res[0].Job.ID, idempotency.StatusDead)
	b.end(t, res[1].Job.ID, idempotency.StatusSucceeded)
	require.Len(t, b.callbacks(t, batch.ID), 1)

	_, err = testworker.Ops(t, b.store, nil).Discard(ctx, res[0].Job.ID, "ops", "customer left")
	require.NoError(t, err)
	b.end(t, res[1].Job.ID, idempotency.StatusDead)
	got, err := b.store.GetBatch(ctx, batch.ID)
	require.NoError(t, err)
	require.Equal(t, []int{0, 1, 1, 1}, []int{got.Succeeded, got.Dead, got.Discarded, got.Generation})
	require.Equal(t, "complete", got.State())
	require.Len(t, b.callbacks(t, batch.ID), 1, "no second callback")
}
