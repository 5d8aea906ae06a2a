package tasks_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/inspect"
	"github.com/keeljobs/keel/internal/testworker"
	"github.com/keeljobs/keel/tasks"
)

var windowed = tasks.Define[keyed]("test:windowed", tasks.Key(func(p keyed) string { return p.Key }),
	tasks.Unique(10*time.Minute))

// finish marks job id ended with status and makes it created ago.
func (b *bundle) finish(t *testing.T, id string, status idempotency.Status, ago time.Duration) {
	t.Helper()
	_, err := b.pool.Exec(context.Background(), `UPDATE keel_jobs SET status = $2, finished_at = now(),
		created_at = now() - $3 * interval '1 millisecond' WHERE id = $1`, id, string(status), ago.Milliseconds())
	require.NoError(t, err)
}

func TestUniqueWindowLetsANewJobInOnceTheWindowHasPassed(t *testing.T) {
	b := setup(t)
	ctx := context.Background()

	first, err := b.client.Enqueue(ctx, windowed.New(keyed{Key: "u1"}))
	require.NoError(t, err)
	b.finish(t, first.Job.ID, idempotency.StatusSucceeded, 5*time.Minute)

	again, err := b.client.Enqueue(ctx, windowed.New(keyed{Key: "u1"}))
	require.NoError(t, err)
	require.True(t, again.Existed, "inside the window the finished job dedupes")
	require.Equal(t, first.Job.ID, again.Job.ID)

	b.finish(t, first.Job.ID, idempotency.StatusSucceeded, 11*time.Minute)
	fresh, err := b.client.Enqueue(ctx, windowed.New(keyed{Key: "u1"}))
	require.NoError(t, err)
	require.False(t, fresh.Existed, "past the window a new job is created")
	require.NotEqual(t, first.Job.ID, fresh.Job.ID)
	require.True(t, fresh.Published)
	require.Equal(t, "u1", fresh.Job.BusinessKey)

	byKey, err := b.store.Lookup(ctx, windowed.Name(), "u1")
	require.NoError(t, err)
	require.Equal(t, fresh.Job.ID, byKey.ID, "the key names the new job")
	old, err := b.store.Get(ctx, first.Job.ID)
	require.NoError(t, err, "the old job's record is kept")
	require.Equal(t, idempotency.StatusSucceeded, old.Status)
	require.NotNil(t, old.SupersededAt)
	require.Equal(t, "u1", old.BusinessKey, "the old job keeps its key")

	// A kind without a window keeps deduping forever.
	plain, err := b.client.Enqueue(ctx, keyedKind.New(keyed{Key: "u1"}))
	require.NoError(t, err)
	b.finish(t, plain.Job.ID, idempotency.StatusSucceeded, 365*24*time.Hour)
	plainAgain, err := b.client.Enqueue(ctx, keyedKind.New(keyed{Key: "u1"}))
	require.NoError(t, err)
	require.True(t, plainAgain.Existed)
}

func TestUniqueWindowNeverStartsASecondLiveJob(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	for _, st := range []idempotency.Status{idempotency.StatusPending, idempotency.StatusRunning, idempotency.StatusFailed} {
		key := "live-" + string(st)
		first, err := b.client.Enqueue(ctx, windowed.New(keyed{Key: key}))
		require.NoError(t, err)
		_, err = b.pool.Exec(ctx, `UPDATE keel_jobs SET status = $2, created_at = now() - interval '1 hour' WHERE id = $1`,
			first.Job.ID, string(st))
		require.NoError(t, err)
		again, err := b.client.Enqueue(ctx, windowed.New(keyed{Key: key}))
		require.NoError(t, err)
		require.True(t, again.Existed, "a %s job is not replaced, however old", st)
		require.Equal(t, first.Job.ID, again.Job.ID)
	}
}

func TestUniqueWindowRacingEnqueuesMakeOneJob(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	const keys, racers = 5, 8
	old := map[string]string{}
	for k := range keys {
		key := fmt.Sprintf("race-%d", k)
		r, err := b.client.Enqueue(ctx, windowed.New(keyed{Key: key}))
		require.NoError(t, err)
		b.finish(t, r.Job.ID, idempotency.StatusSucceeded, time.Hour)
		old[key] = r.Job.ID
	}
	var wg sync.WaitGroup
	created := make(chan string, keys*racers*2)
	errs := make(chan error, keys*racers*2)
	for i := range racers {
		wg.Go(func() {
			for k := range keys {
				key := fmt.Sprintf("race-%d", k)
				var r *tasks.Result
				var err error
				if i%2 == 0 {
					r, err = b.client.Enqueue(ctx, windowed.New(keyed{Key: key}))
				} else {
					var rs []*tasks.Result
					rs, err = b.client.EnqueueMany(ctx, windowed.New(keyed{Key: key}), windowed.New(keyed{Key: key}))
					if err == nil {
						r = rs[0]
					}
				}
				if err != nil {
					errs <- err
					continue
				}
				if !r.Existed {
					created <- r.Job.ID
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	close(created)
	for err := range errs {
		require.NoError(t, err)
	}
	var ids []string
	for id := range created {
		ids = append(ids, id)
	}
	require.Len(t, ids, keys, "one new job per key, whoever won: %v", ids)
	for key, id := range old {
		require.Equal(t, 1, b.count(t, `SELECT count(*) FROM keel_jobs WHERE kind = $1 AND business_key = $2 AND superseded_at IS NULL`,
			windowed.Name(), key), key)
		require.Equal(t, 1, b.count(t, `SELECT count(*) FROM keel_jobs WHERE id = $1 AND superseded_at IS NOT NULL`, id), key)
	}
}

func TestUniqueWindowInBulkAndInTx(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	first, err := b.client.EnqueueMany(ctx, windowed.New(keyed{Key: "bulk-a"}), windowed.New(keyed{Key: "bulk-b"}))
	require.NoError(t, err)
	b.finish(t, first[0].Job.ID, idempotency.StatusDead, time.Hour)
	b.finish(t, first[1].Job.ID, idempotency.StatusSucceeded, time.Minute)

	tx, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	res, err := b.client.EnqueueManyTx(ctx, tx, windowed.New(keyed{Key: "bulk-a"}), windowed.New(keyed{Key: "bulk-b"}))
	require.NoError(t, err)
	require.False(t, res[0].Existed, "a dead job past the window is replaced")
	require.True(t, res[1].Existed, "inside the window")
	require.NoError(t, tx.Rollback(ctx))
	got, err := b.store.Lookup(ctx, windowed.Name(), "bulk-a")
	require.NoError(t, err)
	require.Equal(t, first[0].Job.ID, got.ID, "a rolled-back transaction supersedes nothing")
	require.Nil(t, got.SupersededAt)

	tx, err = b.pool.Begin(ctx)
	require.NoError(t, err)
	one, err := b.client.EnqueueTx(ctx, tx, windowed.New(keyed{Key: "bulk-a"}))
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	require.False(t, one.Existed)
	got, err = b.store.Lookup(ctx, windowed.Name(), "bulk-a")
	require.NoError(t, err)
	require.Equal(t, one.Job.ID, got.ID)

	_, err = testworker.Ops(t, b.store, nil).Replay(ctx, first[0].Job.ID, "operator", "")
	require.ErrorIs(t, err, inspect.ErrNotDead, "a superseded dead job is not replayed beside its key's new job")
	require.ErrorContains(t, err, "superseded")
}

func TestSameKeyDifferentPayloadIsReported(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	first, err := b.client.Enqueue(ctx, keyedKind.New(keyed{Key: "pd", Body: "one"}))
	require.NoError(t, err)
	require.False(t, first.PayloadDiffers)

	same, err := b.client.Enqueue(ctx, keyedKind.New(keyed{Key: "pd", Body: "one"}))
	require.NoError(t, err)
	require.True(t, same.Existed)
	require.False(t, same.PayloadDiffers)

	other, err := b.client.Enqueue(ctx, keyedKind.New(keyed{Key: "pd", Body: "two"}))
	require.NoError(t, err)
	require.True(t, other.Existed)
	require.True(t, other.PayloadDiffers, "the existing job keeps its payload; the caller is told")
	require.JSONEq(t, `{"key":"pd","body":"one"}`, string(other.Job.Payload))

	many, err := b.client.EnqueueMany(ctx, keyedKind.New(keyed{Key: "pd", Body: "one"}), keyedKind.New(keyed{Key: "pd", Body: "three"}),
		keyedKind.New(keyed{Key: "pd2", Body: "x"}), keyedKind.New(keyed{Key: "pd2", Body: "y"}))
	require.NoError(t, err)
	require.False(t, many[0].PayloadDiffers)
	require.True(t, many[1].PayloadDiffers)
	require.False(t, many[2].PayloadDiffers)
	require.True(t, many[3].PayloadDiffers, "a later task of the call with another payload")
}

func TestUniqueRefusesANegativeWindow(t *testing.T) {
	b := setup(t)
	_, err := b.client.Enqueue(context.Background(), keyedKind.New(keyed{Key: "neg"}, tasks.Unique(-time.Second)))
	require.ErrorIs(t, err, tasks.ErrInvalidTask)
}
