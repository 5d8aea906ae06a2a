package executor_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/jobstore"
	"github.com/keeljobs/keel/tasks"
)

func bulkJob(key string) jobstore.NewJob {
	return jobstore.NewJob{Kind: "test:bulk", BusinessKey: key, Queue: "default", Payload: []byte(`{"k":"` + key + `"}`), MaxRetry: 3}
}

func TestInsertManyDeduplicatesWithinTheCallAndAgainstTheLedger(t *testing.T) {
	b := setup(t)
	ctx := context.Background()

	old, existed, err := b.store.Insert(ctx, b.pool, bulkJob("b"))
	require.NoError(t, err)
	require.False(t, existed)

	jobs := []jobstore.NewJob{bulkJob("c"), bulkJob("b"), bulkJob("a"), bulkJob("c")}
	jobs[0].PayloadSummary, jobs[0].TraceID = "first c", "trace-c"
	got, err := b.store.InsertMany(ctx, b.pool, jobs, jobstore.InsertOptions{})
	require.NoError(t, err)
	require.Len(t, got, 4)

	require.False(t, got[0].Existed, "the first c creates the row")
	require.True(t, got[1].Existed, "b was in the ledger")
	require.Equal(t, old.ID, got[1].Job.ID)
	require.False(t, got[2].Existed)
	require.True(t, got[3].Existed, "the second c of the call is the first c's job")
	require.Equal(t, got[0].Job.ID, got[3].Job.ID)
	for i, g := range got {
		require.Equal(t, jobs[i].BusinessKey, g.Job.BusinessKey, "result %d is in the order of the call", i)
		require.Equal(t, idempotency.StatusPending, g.Job.Status)
		require.Nil(t, g.Job.PublishedAt, "without Claim new rows wait for the relay")
	}
	require.Equal(t, "first c", got[0].Job.PayloadSummary)
	require.Equal(t, "trace-c", got[0].Job.TraceID)
	require.Equal(t, 3, got[0].Job.MaxRetry)
	require.JSONEq(t, `{"k":"c"}`, string(got[0].Job.Payload))
	require.Equal(t, 3, b.count(t, `SELECT count(*) FROM keel_jobs WHERE kind = 'test:bulk'`))
}

func TestInsertManyClaimMarksNewRowsPublished(t *testing.T) {
	b := setup(t)
	ctx := context.Background()

	pending, _, err := b.store.Insert(ctx, b.pool, bulkJob("unpublished"))
	require.NoError(t, err)
	got, err := b.store.InsertMany(ctx, b.pool, []jobstore.NewJob{bulkJob("new"), bulkJob("unpublished")},
		jobstore.InsertOptions{Claim: true})
	require.NoError(t, err)
	require.NotNil(t, got[0].Job.PublishedAt, "a claimed row is the caller's to publish")
	require.True(t, got[1].Existed)
	require.Equal(t, pending.ID, got[1].Job.ID)
	require.Nil(t, got[1].Job.PublishedAt, "an existing row is left as it was")
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM keel_jobs WHERE published_at IS NULL`))
}

func TestInsertManyRefusesAnInvalidJobAndWritesNothing(t *testing.T) {
	b := setup(t)
	ctx := context.Background()

	jobs := []jobstore.NewJob{bulkJob("ok-1"), bulkJob("ok-2"), bulkJob("bad\x00key")}
	_, err := b.store.InsertMany(ctx, b.pool, jobs, jobstore.InsertOptions{})
	require.ErrorContains(t, err, "job 2")
	require.ErrorContains(t, err, "NUL")
	require.Equal(t, 0, b.count(t, `SELECT count(*) FROM keel_jobs`))
}

// A call bigger than one statement's chunk through a pool is still all or
// nothing: its chunks share one transaction.
func TestInsertManyChunksInOneTransaction(t *testing.T) {
	b := setup(t)
	ctx := context.Background()

	n := 2*jobstore.InsertChunkRows + 10
	jobs := make([]jobstore.NewJob, n)
	for i := range jobs {
		jobs[i] = bulkJob(fmt.Sprintf("k-%05d", i))
	}
	got, err := b.store.InsertMany(ctx, b.pool, jobs, jobstore.InsertOptions{})
	require.NoError(t, err)
	require.Len(t, got, n)
	require.Equal(t, n, b.count(t, `SELECT count(*) FROM keel_jobs`))
	var xids int
	require.NoError(t, b.pool.QueryRow(ctx, `SELECT count(DISTINCT xmin::text) FROM keel_jobs`).Scan(&xids))
	require.Equal(t, 1, xids, "every chunk commits in one transaction")

	// The last chunk fails on a row the database refuses: nothing of the
	// call stays.
	for i := range jobs {
		jobs[i] = bulkJob(fmt.Sprintf("again-%05d", i))
	}
	jobs[n-1].Queue = "q\x00" // Postgres text cannot hold a NUL byte
	_, err = b.store.InsertMany(ctx, b.pool, jobs, jobstore.InsertOptions{})
	require.Error(t, err)
	require.Equal(t, 0, b.count(t, `SELECT count(*) FROM keel_jobs WHERE business_key LIKE 'again-%'`))
}

// Concurrent calls with overlapping keys, in opposite orders, neither
// deadlock nor duplicate: one row per key, and each key created once.
func TestInsertManyConcurrentOverlappingCalls(t *testing.T) {
	b := setup(t)
	ctx := context.Background()

	const keys, callers = 300, 8
	var wg sync.WaitGroup
	created := make([]map[string]string, callers)
	errs := make([]error, callers)
	for c := range callers {
		wg.Go(func() {
			jobs := make([]jobstore.NewJob, keys)
			for i := range jobs {
				k := i
				if c%2 == 1 {
					k = keys - 1 - i
				}
				jobs[i] = bulkJob(fmt.Sprintf("o-%03d", k))
			}
			err := pgx.BeginFunc(ctx, b.pool, func(tx pgx.Tx) error {
				got, err := b.store.InsertMany(ctx, tx, jobs, jobstore.InsertOptions{WakeRelay: true})
				created[c] = map[string]string{}
				for _, g := range got {
					if !g.Existed {
						created[c][g.Job.BusinessKey] = g.Job.ID
					}
				}
				return err
			})
			errs[c] = err
		})
	}
	wg.Wait()
	total := 0
	for c := range callers {
		require.NoError(t, errs[c])
		total += len(created[c])
	}
	require.Equal(t, keys, total, "each key is created by exactly one call")
	require.Equal(t, keys, b.count(t, `SELECT count(*) FROM keel_jobs`))
}

// What Insert and InsertMany return for a new row is the row as stored,
// field for field: callers publish from it and show it.
func TestInsertedJobsAreTheStoredRows(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	batch, err := b.client.NewBatch(ctx, tasks.BatchSpec{Description: "returned rows"})
	require.NoError(t, err)
	rich := func(key string, runAt time.Time) jobstore.NewJob {
		return jobstore.NewJob{Kind: "test:returned", BusinessKey: key, Queue: "critical", Payload: []byte(`{"k":1}`),
			MaxRetry: 7, Timeout: 1500*time.Millisecond + 999*time.Microsecond, MaxWait: time.Hour,
			Deadline: time.Now().Add(time.Hour).Add(123 * time.Nanosecond), RunAt: runAt,
			PayloadSummary: "order " + key, TraceID: "trace-" + key,
			TraceParent: "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", TraceState: "vendor=x",
			BatchID: batch.ID}
	}
	bare := func(key string) jobstore.NewJob {
		return jobstore.NewJob{Kind: "test:returned", BusinessKey: key, Queue: "default", MaxRetry: 0}
	}
	later := time.Now().Add(time.Hour).Add(456 * time.Nanosecond)
	earlier := time.Now().Add(-time.Minute).Add(789 * time.Nanosecond)
	check := func(what string, j idempotency.Job) {
		t.Helper()
		stored, err := b.store.Get(ctx, j.ID)
		require.NoError(t, err)
		require.Equal(t, stored, j, what)
	}
	n := 0
	for _, wake := range []bool{false, true} {
		for _, nj := range []jobstore.NewJob{rich("", time.Time{}), rich("", later), rich("", earlier), bare("")} {
			n++
			nj.BusinessKey, nj.WakeRelay = fmt.Sprintf("one-%d", n), wake
			j, existed, err := b.store.Insert(ctx, b.pool, nj)
			require.NoError(t, err)
			require.False(t, existed)
			check(fmt.Sprintf("Insert %s, wake %v", nj.BusinessKey, wake), j)
		}
	}
	for _, opts := range []jobstore.InsertOptions{{}, {Claim: true}, {WakeRelay: true}} {
		n++
		jobs := []jobstore.NewJob{rich(fmt.Sprintf("many-%d-a", n), time.Time{}), rich(fmt.Sprintf("many-%d-b", n), later),
			bare(fmt.Sprintf("many-%d-c", n)), rich(fmt.Sprintf("many-%d-d", n), earlier)}
		got, err := b.store.InsertMany(ctx, b.pool, jobs, opts)
		require.NoError(t, err)
		for i, g := range got {
			require.False(t, g.Existed)
			check(fmt.Sprintf("InsertMany %+v, job %d", opts, i), g.Job)
		}
	}
	// The returned payload is the row's, not the caller's buffer.
	buf := []byte(`{"k":1}`)
	nj := rich("own-buffer", time.Time{})
	nj.Payload = buf
	j, _, err := b.store.Insert(ctx, b.pool, nj)
	require.NoError(t, err)
	nj.BusinessKey, nj.Payload = "own-buffer-many", buf
	got, err := b.store.InsertMany(ctx, b.pool, []jobstore.NewJob{nj}, jobstore.InsertOptions{})
	require.NoError(t, err)
	copy(buf, "XXXXXXX")
	require.Equal(t, `{"k":1}`, string(j.Payload))
	require.Equal(t, `{"k":1}`, string(got[0].Job.Payload))
}

// A retry budget over what the ledger's 32-bit column holds is refused by
// Insert and InsertMany alike, naming the job, and nothing is written.
func TestInsertRefusesAMaxRetryTheLedgerCannotHold(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	huge := bulkJob("huge")
	huge.MaxRetry = 1 << 31
	_, _, err := b.store.Insert(ctx, b.pool, huge)
	require.ErrorContains(t, err, "max retry 2147483648")
	_, err = b.store.InsertMany(ctx, b.pool, []jobstore.NewJob{bulkJob("fine"), huge}, jobstore.InsertOptions{})
	require.ErrorContains(t, err, "job 1 (test:bulk, key \"huge\")")
	require.ErrorContains(t, err, "max retry 2147483648")
	require.Equal(t, 0, b.count(t, `SELECT count(*) FROM keel_jobs`))
}
