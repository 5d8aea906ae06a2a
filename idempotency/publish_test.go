package idempotency_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/hibiken/asynq"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/idempotency"
)

// PublishMany puts every job in Redis once under its ledger id, says which
// were new, marks the unmarked ones in the ledger, and lets one job asynq
// refuses fail alone.
func TestPublishManyPublishesEachJobOnceAndMarksIt(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	insp := asynq.NewInspector(b.redis)
	defer insp.Close()
	ac := asynq.NewClient(b.redis)
	defer ac.Close()

	var jobs []idempotency.Job
	for i := range 3 * idempotency.PublishInFlight {
		j, _, err := b.store.Insert(ctx, b.pool, idempotency.NewJob{Kind: "publish:many", BusinessKey: fmt.Sprint("k-", i),
			Queue: "default", Payload: []byte("{}"), MaxRetry: 3})
		require.NoError(t, err)
		jobs = append(jobs, j)
	}
	// One job Redis holds already (a repeated publish), one asynq refuses.
	_, err := ac.EnqueueContext(ctx, idempotency.Task(jobs[5]), idempotency.TaskOptions(jobs[5])...)
	require.NoError(t, err)
	jobs[9].Kind = " "

	res, markErr := b.store.PublishMany(ctx, ac, jobs)
	require.NoError(t, markErr)
	require.Len(t, res, len(jobs))
	for i, p := range res {
		switch i {
		case 5:
			require.NoError(t, p.Err)
			require.False(t, p.New, "Redis held job 5 already")
		case 9:
			require.Error(t, p.Err)
		default:
			require.NoError(t, p.Err, "job %d", i)
			require.True(t, p.New, "job %d", i)
		}
	}
	for i, j := range jobs {
		info, err := insp.GetTaskInfo("default", j.ID)
		got, gerr := b.store.Get(ctx, j.ID)
		require.NoError(t, gerr)
		if i == 9 {
			require.ErrorIs(t, err, asynq.ErrTaskNotFound)
			require.Nil(t, got.PublishedAt, "a job that was not published stays unmarked")
			continue
		}
		require.NoError(t, err)
		require.Equal(t, "publish:many", info.Type)
		require.Equal(t, j.BusinessKey, info.Headers[idempotency.HeaderBusinessKey])
		require.NotNil(t, got.PublishedAt, "job %d was published but not marked", i)
	}
	qi, err := insp.GetQueueInfo("default")
	require.NoError(t, err)
	require.Equal(t, len(jobs)-1, qi.Pending, "every job once")

	// Again: nothing new, nothing twice.
	res, markErr = b.store.PublishMany(ctx, ac, append(jobs[:9:9], jobs[10:]...))
	require.NoError(t, markErr)
	for _, p := range res {
		require.NoError(t, p.Err)
		require.False(t, p.New)
	}
	qi, err = insp.GetQueueInfo("default")
	require.NoError(t, err)
	require.Equal(t, len(jobs)-1, qi.Pending)
}
