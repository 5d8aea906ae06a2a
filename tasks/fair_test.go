package tasks_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/tasks"
)

type order struct {
	Customer string `json:"customer"`
	ID       string `json:"id"`
}

var perCustomer = tasks.Define[order]("test:per_customer",
	tasks.Key(func(o order) string { return o.ID }),
	tasks.ConcurrencyKey(func(o order) string { return o.Customer }, 1))

func TestConcurrencyKeyIsTheKindsAndComesFromThePayload(t *testing.T) {
	key, limit := perCustomer.New(order{Customer: "acme", ID: "1"}).ConcurrencyKey()
	require.Equal(t, "acme", key)
	require.Equal(t, 1, limit)
	key, limit = perCustomer.New(order{ID: "2"}).ConcurrencyKey()
	require.Equal(t, "", key, "an empty key is no limit")
	require.Equal(t, 0, limit)

	require.Panics(t, func() {
		tasks.Define[order]("test:bad_limit", tasks.Key(func(o order) string { return o.ID }),
			tasks.ConcurrencyKey(func(o order) string { return o.Customer }, 0))
	})
	require.Panics(t, func() {
		tasks.Define[order]("test:other_type", tasks.Key(func(o order) string { return o.ID }),
			tasks.ConcurrencyKey(func(s string) string { return s }, 1))
	})
	err := tasks.CheckTasks(nil, perCustomer.New(order{ID: "3"}, tasks.ConcurrencyKey(func(o order) string { return o.ID }, 1)))
	require.ErrorIs(t, err, tasks.ErrInvalidTask)

	// A raw task of the kind (the CLI, a schedule file) gets its key too.
	kinds := tasks.NewKinds(perCustomer)
	key, limit = kinds.NewRaw(perCustomer.Name(), []byte(`{"customer":"globex","id":"4"}`), "4").ConcurrencyKey()
	require.Equal(t, "globex", key)
	require.Equal(t, 1, limit)
	require.ErrorIs(t, tasks.CheckTasks(nil, kinds.NewRaw(perCustomer.Name(), []byte(`[1]`), "5")), tasks.ErrInvalidTask)
}

// A batch member past its key's limit is held like any other job, and its
// enqueue does not publish it.
func TestAHeldBatchMemberIsNotPublished(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	batch, err := b.client.NewBatch(ctx, tasks.BatchSpec{Description: "fair"})
	require.NoError(t, err)
	var res []*tasks.Result
	for i := range 3 {
		r, err := b.client.Enqueue(ctx, perCustomer.New(order{Customer: "acme", ID: fmt.Sprint("m", i)}, tasks.InBatch(batch.ID)))
		require.NoError(t, err)
		res = append(res, r)
	}
	require.True(t, res[0].Published)
	for _, r := range res[1:] {
		require.False(t, r.Published)
		require.Equal(t, idempotency.StatusWaiting, r.Job.Status)
		require.True(t, r.Job.HeldForKey())
	}
	q, err := b.insp.GetQueueInfo("default")
	require.NoError(t, err)
	require.Equal(t, 1, q.Pending)

	// The held ones go, one at a time, as the one before ends.
	b.end(t, res[0].Job.ID, idempotency.StatusSucceeded)
	j, err := b.store.Get(ctx, res[1].Job.ID)
	require.NoError(t, err)
	require.Equal(t, idempotency.StatusPending, j.Status)
	require.False(t, j.HeldForKey())
	j, err = b.store.Get(ctx, res[2].Job.ID)
	require.NoError(t, err)
	require.True(t, j.HeldForKey())
}
