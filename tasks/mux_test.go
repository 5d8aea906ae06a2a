package tasks_test

import (
	"context"
	"errors"
	"testing"

	"github.com/hibiken/asynq"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/retry"
	"github.com/keeljobs/keel/tasks"
)

func TestMuxRoutesByKind(t *testing.T) {
	ctx := context.Background()
	mux := tasks.NewMux()
	var got []receipt
	tasks.Handle(mux, sendReceipt, func(ctx context.Context, r receipt) error {
		got = append(got, r)
		return nil
	})
	mux.HandleTask("test:raw", asynq.HandlerFunc(func(context.Context, *asynq.Task) error { return errors.New("raw ran") }))
	require.Equal(t, []string{"test:raw", "test:send_receipt"}, mux.Kinds())

	require.NoError(t, mux.ProcessTask(ctx, asynq.NewTask("test:send_receipt", mustJSON(t, receipt{OrderID: "9"}))))
	require.Equal(t, []receipt{{OrderID: "9"}}, got)
	require.EqualError(t, mux.ProcessTask(ctx, asynq.NewTask("test:raw", nil)), "raw ran")

	// A payload that does not decode never reaches the handler and is not retried.
	err := mux.ProcessTask(ctx, asynq.NewTask("test:send_receipt", []byte(`{"order_id":`)))
	require.ErrorIs(t, err, retry.ErrPermanent)
	require.Len(t, got, 1)
}

// A worker that does not know a kind may be older than the producer (a
// rolling deploy): the job is retried, not thrown away.
func TestMuxUnknownKindIsTransient(t *testing.T) {
	mux := tasks.NewMux()
	tasks.Handle(mux, sendReceipt, func(context.Context, receipt) error { return nil })
	err := mux.ProcessTask(context.Background(), asynq.NewTask("test:from_the_future", nil))
	require.ErrorIs(t, err, tasks.ErrNoHandler)
	require.ErrorContains(t, err, `"test:from_the_future"`)
	require.Equal(t, retry.ClassTransient, retry.Classify(err))
	require.False(t, errors.Is(err, asynq.SkipRetry))
}

func TestMuxRefusesDuplicateAndEmptyRegistrations(t *testing.T) {
	mux := tasks.NewMux()
	h := asynq.HandlerFunc(func(context.Context, *asynq.Task) error { return nil })
	mux.HandleTask("test:once", h)
	require.Contains(t, panicMessage(func() { mux.HandleTask("test:once", h) }), `"test:once"`)
	tasks.Handle(mux, sendReceipt, func(context.Context, receipt) error { return nil })
	require.Contains(t, panicMessage(func() {
		tasks.Handle(mux, sendReceipt, func(context.Context, receipt) error { return nil })
	}), "registered twice")
	require.NotEqual(t, "<no panic>", panicMessage(func() { mux.HandleTask("", h) }))
	require.NotEqual(t, "<no panic>", panicMessage(func() { mux.HandleTask("test:nil", nil) }))
}
