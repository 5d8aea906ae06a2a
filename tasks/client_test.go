package tasks_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/jobstore"
	"github.com/keeljobs/keel/internal/ledger"
	"github.com/keeljobs/keel/outbox"
	"github.com/keeljobs/keel/tasks"
)

type receipt struct {
	OrderID string `json:"order_id"`
}

type keyed struct {
	Key  string `json:"key"`
	Body string `json:"body"`
}

var (
	sendReceipt = tasks.Define[receipt]("test:send_receipt", tasks.Queue("critical"), tasks.MaxRetry(4),
		tasks.Key(func(r receipt) string { return "order:" + r.OrderID }))
	// keyedKind takes its business key from the payload as is, so tests can
	// hand it any key.
	keyedKind = tasks.Define[keyed]("test:keyed", tasks.Key(func(p keyed) string { return p.Key }))
	blob      = tasks.Define[string]("test:blob", tasks.Key(func(string) string { return "blob" }))
	anything  = tasks.Define[any]("test:any", tasks.Key(func(any) string { return "any" }))
)

func quietLogger() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

func TestEnqueuePublishesWithLedgerIDAsTaskID(t *testing.T) {
	b := setup(t)
	ctx := context.Background()

	res, err := b.client.Enqueue(ctx, sendReceipt.New(receipt{OrderID: "42"}))
	require.NoError(t, err)
	require.True(t, res.Published)
	require.False(t, res.Existed)

	j, err := b.store.Get(ctx, res.Job.ID)
	require.NoError(t, err)
	require.Equal(t, idempotency.StatusPending, j.Status)
	require.NotNil(t, j.PublishedAt, "a published job must have published_at set")
	require.Equal(t, "test:send_receipt", j.Kind)
	require.Equal(t, "order:42", j.BusinessKey)
	require.Equal(t, "critical", j.Queue)
	require.Equal(t, 4, j.MaxRetry)
	require.JSONEq(t, `{"order_id":"42"}`, string(j.Payload))

	info, err := b.insp.GetTaskInfo("critical", res.Job.ID)
	require.NoError(t, err, "asynq must hold the task under the ledger id")
	require.Equal(t, res.Job.ID, info.ID)
	require.Equal(t, "test:send_receipt", info.Type)
	require.Equal(t, "critical", info.Queue)
	require.Equal(t, 4+jobstore.AsynqRetryHeadroom, info.MaxRetry, "the ledger decides the budget; asynq's last try lies beyond it")
	require.Equal(t, asynq.TaskStatePending, info.State)
	require.Equal(t, "order:42", info.Headers[tasks.HeaderBusinessKey])
	require.Equal(t, j.Payload, info.Payload)

	// The same business action again: the existing job, nothing new in Redis.
	again, err := b.client.Enqueue(ctx, sendReceipt.New(receipt{OrderID: "42"}))
	require.NoError(t, err)
	require.True(t, again.Existed)
	require.False(t, again.Published)
	require.Equal(t, res.Job.ID, again.Job.ID)
	q, err := b.insp.GetQueueInfo("critical")
	require.NoError(t, err)
	require.Equal(t, 1, q.Size)
}

func TestEnqueuePayloadLimit(t *testing.T) {
	b := setup(t)
	ctx := context.Background()

	// A JSON string is its characters plus two quotes.
	exact := blob.New(strings.Repeat("a", tasks.MaxPayloadBytes-2), tasks.BusinessKey("exact"))
	require.Len(t, exact.Payload(), tasks.MaxPayloadBytes)
	res, err := b.client.Enqueue(ctx, exact)
	require.NoError(t, err, "a payload of exactly the limit is accepted")
	require.True(t, res.Published)
	j, err := b.store.Get(ctx, res.Job.ID)
	require.NoError(t, err)
	require.Equal(t, exact.Payload(), j.Payload)

	over := blob.New(strings.Repeat("a", tasks.MaxPayloadBytes-1), tasks.BusinessKey("over"))
	require.Len(t, over.Payload(), tasks.MaxPayloadBytes+1)
	_, err = b.client.Enqueue(ctx, over)
	require.ErrorIs(t, err, tasks.ErrPayloadTooLarge)
	require.ErrorContains(t, err, "test:blob")
	require.ErrorContains(t, err, strconv.Itoa(tasks.MaxPayloadBytes+1))
	require.ErrorContains(t, err, strconv.Itoa(tasks.MaxPayloadBytes))

	raw := []byte(`"` + strings.Repeat("b", tasks.MaxPayloadBytes) + `"`)
	_, err = b.client.Enqueue(ctx, tasks.NewRaw("test:raw", raw, "raw-over"))
	require.ErrorIs(t, err, tasks.ErrPayloadTooLarge)
	require.ErrorContains(t, err, "test:raw")
	require.ErrorContains(t, err, strconv.Itoa(len(raw)))

	_, err = b.client.EnqueueTx(ctx, nil, over)
	require.ErrorIs(t, err, tasks.ErrPayloadTooLarge, "EnqueueTx checks before touching the transaction")

	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM keel_jobs`), "refused payloads must not reach the ledger")
}

func TestEnqueueRefusesBadBusinessKeys(t *testing.T) {
	b := setup(t)
	ctx := context.Background()

	for _, tc := range []struct {
		name, key, reason string
	}{
		{"empty", "", "empty"},
		{"NUL byte", "order:\x00:1", "NUL"},
		{"invalid UTF-8", "order:\xff\xfe", "UTF-8"},
		{"too long", strings.Repeat("k", ledger.MaxBusinessKeyBytes+1), strconv.Itoa(ledger.MaxBusinessKeyBytes + 1)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := b.client.Enqueue(ctx, keyedKind.New(keyed{Key: tc.key}))
			require.ErrorIs(t, err, tasks.ErrInvalidKey)
			require.ErrorContains(t, err, "test:keyed")
			require.ErrorContains(t, err, tc.reason)

			_, err = b.client.Enqueue(ctx, tasks.NewRaw("test:raw", []byte(`{}`), tc.key))
			require.ErrorIs(t, err, tasks.ErrInvalidKey)
			require.ErrorContains(t, err, "test:raw")
		})
	}
	require.Equal(t, 0, b.count(t, `SELECT count(*) FROM keel_jobs`))

	// The longest key allowed, and keys with quotes and the like, round-trip.
	for _, key := range []string{strings.Repeat("k", ledger.MaxBusinessKeyBytes), `o'rder "1" \ ; DROP TABLE keel_jobs; --`, "заказ:🧾"} {
		res, err := b.client.Enqueue(ctx, keyedKind.New(keyed{Key: key}))
		require.NoError(t, err)
		got, err := b.store.Lookup(ctx, "test:keyed", key)
		require.NoError(t, err)
		require.Equal(t, res.Job.ID, got.ID)
		require.Equal(t, key, got.BusinessKey)
	}
}

func TestEnqueueQueues(t *testing.T) {
	b := setup(t)
	ctx := context.Background()

	_, err := b.client.Enqueue(ctx, sendReceipt.New(receipt{OrderID: "1"}, tasks.Queue("critcal")))
	require.ErrorIs(t, err, tasks.ErrUnknownQueue)
	require.ErrorContains(t, err, `"critcal"`)
	require.ErrorContains(t, err, "test:send_receipt")

	for _, q := range tasks.DefaultQueues {
		res, err := b.client.Enqueue(ctx, sendReceipt.New(receipt{OrderID: "q-" + q}, tasks.Queue(q)))
		require.NoError(t, err, "queue %s", q)
		require.Equal(t, q, res.Job.Queue)
	}

	// A client configured with its own queues accepts those and only those.
	c, err := tasks.NewClient(tasks.ClientConfig{Redis: b.redis, Pool: b.pool, Queues: []string{"emails", "reports"}})
	require.NoError(t, err)
	defer c.Close()
	res, err := c.Enqueue(ctx, sendReceipt.New(receipt{OrderID: "custom"}, tasks.Queue("emails")))
	require.NoError(t, err)
	require.True(t, res.Published)
	info, err := b.insp.GetTaskInfo("emails", res.Job.ID)
	require.NoError(t, err)
	require.Equal(t, "emails", info.Queue)

	_, err = c.Enqueue(ctx, sendReceipt.New(receipt{OrderID: "custom-bulk"}, tasks.Queue("bulk")))
	require.ErrorIs(t, err, tasks.ErrUnknownQueue)
	require.ErrorContains(t, err, `"bulk"`)
	require.ErrorContains(t, err, "emails")

	// The queue a declared kind names is accepted for that kind's tasks,
	// made with New or NewRaw...
	res, err = c.Enqueue(ctx, sendReceipt.New(receipt{OrderID: "custom-critical"}))
	require.NoError(t, err)
	require.Equal(t, "critical", res.Job.Queue)
	res, err = c.Enqueue(ctx, tasks.NewKinds(sendReceipt).NewRaw("test:send_receipt", []byte(`{"order_id":"raw"}`), "order:raw"))
	require.NoError(t, err)
	require.Equal(t, "critical", res.Job.Queue)
	// ...and not for the tasks of other kinds: declaring a kind does not
	// widen every client's queues.
	_, err = c.Enqueue(ctx, keyedKind.New(keyed{Key: "k"}, tasks.Queue("critical")))
	require.ErrorIs(t, err, tasks.ErrUnknownQueue)
	require.ErrorContains(t, err, "test:keyed")
	_, err = c.Enqueue(ctx, tasks.NewRaw("test:undeclared", []byte(`{}`), "k", tasks.Queue("critical")))
	require.ErrorIs(t, err, tasks.ErrUnknownQueue)
}

func TestEnqueueRefusesInvalidTasks(t *testing.T) {
	b := setup(t)
	ctx := context.Background()

	_, err := b.client.Enqueue(ctx, nil)
	require.ErrorIs(t, err, tasks.ErrInvalidTask)
	require.ErrorContains(t, err, "nil task")

	_, err = b.client.Enqueue(ctx, sendReceipt.New(receipt{OrderID: "neg"}, tasks.MaxRetry(-1)))
	require.ErrorIs(t, err, tasks.ErrInvalidTask)
	require.ErrorContains(t, err, "test:send_receipt")
	require.ErrorContains(t, err, "-1")

	_, err = b.client.Enqueue(ctx, sendReceipt.New(receipt{OrderID: "neg"}, tasks.Timeout(-time.Second)))
	require.ErrorIs(t, err, tasks.ErrInvalidTask)

	_, err = b.client.Enqueue(ctx, anything.New(make(chan int)))
	require.ErrorIs(t, err, tasks.ErrInvalidTask)
	require.ErrorContains(t, err, "test:any")

	_, err = b.client.Enqueue(ctx, tasks.NewRaw("", []byte(`{}`), "k"))
	require.ErrorIs(t, err, tasks.ErrInvalidTask)

	// A budget the ledger cannot hold (a 32-bit column) is refused, by
	// every method, rather than stored wrapped around.
	huge := sendReceipt.New(receipt{OrderID: "huge"}, tasks.MaxRetry(1<<31))
	_, err = b.client.Enqueue(ctx, huge)
	require.ErrorIs(t, err, tasks.ErrInvalidTask)
	require.ErrorContains(t, err, "2147483648")
	_, err = b.client.EnqueueMany(ctx, huge)
	require.ErrorIs(t, err, tasks.ErrInvalidTask)
	require.NoError(t, pgx.BeginFunc(ctx, b.pool, func(tx pgx.Tx) error {
		_, err := b.client.EnqueueTx(ctx, tx, huge)
		require.ErrorIs(t, err, tasks.ErrInvalidTask)
		return nil
	}))

	// Zero retries is a valid budget.
	res, err := b.client.Enqueue(ctx, sendReceipt.New(receipt{OrderID: "zero"}, tasks.MaxRetry(0)))
	require.NoError(t, err)
	require.Equal(t, 0, res.Job.MaxRetry)

	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM keel_jobs`))
}

func TestNewClientRequiresRedisAndPool(t *testing.T) {
	b := setup(t)
	_, err := tasks.NewClient(tasks.ClientConfig{Pool: b.pool})
	require.ErrorContains(t, err, "Redis")
	_, err = tasks.NewClient(tasks.ClientConfig{Redis: b.redis})
	require.ErrorContains(t, err, "Pool")
}

// Invariant 2: a job accepted while Redis is down is not lost; the relay
// publishes it once Redis answers.
func TestEnqueueWithRedisDownIsPublishedByRelay(t *testing.T) {
	b := setup(t)
	ctx := context.Background()

	down, err := tasks.NewClient(tasks.ClientConfig{
		Redis:  asynq.RedisClientOpt{Addr: "127.0.0.1:1", DialTimeout: time.Second},
		Pool:   b.pool,
		Logger: quietLogger(),
	})
	require.NoError(t, err)
	defer down.Close()

	res, err := down.Enqueue(ctx, sendReceipt.New(receipt{OrderID: "offline"}))
	require.NoError(t, err, "an unreachable Redis must not fail a durable enqueue")
	require.False(t, res.Published)
	j, err := b.store.Get(ctx, res.Job.ID)
	require.NoError(t, err)
	require.Equal(t, idempotency.StatusPending, j.Status)
	require.Nil(t, j.PublishedAt, "the relay finds the job by its NULL published_at")
	_, err = b.insp.GetTaskInfo("critical", res.Job.ID)
	require.True(t, errors.Is(err, asynq.ErrTaskNotFound) || errors.Is(err, asynq.ErrQueueNotFound), "got %v", err)

	relay, err := outbox.NewRelay(outbox.RelayConfig{Pool: b.pool, Redis: b.redis, Logger: quietLogger()})
	require.NoError(t, err)
	defer relay.Close()
	n, err := relay.PublishBatch(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, n)

	info, err := b.insp.GetTaskInfo("critical", res.Job.ID)
	require.NoError(t, err)
	require.Equal(t, "order:offline", info.Headers[tasks.HeaderBusinessKey])
	require.Equal(t, asynq.TaskStatePending, info.State)
	j, err = b.store.Get(ctx, res.Job.ID)
	require.NoError(t, err)
	require.NotNil(t, j.PublishedAt)

	n, err = relay.PublishBatch(ctx)
	require.NoError(t, err)
	require.Equal(t, 0, n, "a published job is not published again")
}

func TestEnqueueTxFollowsTheTransaction(t *testing.T) {
	b := setup(t)
	ctx := context.Background()

	tx, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	_, err = b.client.EnqueueTx(ctx, tx, sendReceipt.New(receipt{OrderID: "rolled-back"}))
	require.NoError(t, err)
	require.NoError(t, tx.Rollback(ctx))
	_, err = b.store.Lookup(ctx, "test:send_receipt", "order:rolled-back")
	require.ErrorIs(t, err, idempotency.ErrNotFound)

	var res *tasks.Result
	require.NoError(t, pgx.BeginFunc(ctx, b.pool, func(tx pgx.Tx) error {
		res, err = b.client.EnqueueTx(ctx, tx, sendReceipt.New(receipt{OrderID: "committed"}))
		return err
	}))
	require.False(t, res.Published, "EnqueueTx leaves publishing to the relay")
	j, err := b.store.Lookup(ctx, "test:send_receipt", "order:committed")
	require.NoError(t, err)
	require.Equal(t, res.Job.ID, j.ID)
	var outboxed int
	require.NoError(t, b.pool.QueryRow(ctx, `SELECT count(*) FROM keel_outbox WHERE job_id = $1`, j.ID).Scan(&outboxed))
	require.Equal(t, 1, outboxed, "the job waits on the relay's outbox")
}

func TestEnqueueDelayIsKeptInLedgerAndRedis(t *testing.T) {
	b := setup(t)
	ctx := context.Background()

	before := time.Now()
	res, err := b.client.Enqueue(ctx, sendReceipt.New(receipt{OrderID: "later"}, tasks.Delay(time.Hour)))
	require.NoError(t, err)
	require.False(t, res.Job.RunAt.Before(before.Add(time.Hour)), "run_at %s is before enqueue + delay", res.Job.RunAt)
	info, err := b.insp.GetTaskInfo("critical", res.Job.ID)
	require.NoError(t, err)
	require.Equal(t, asynq.TaskStateScheduled, info.State)
	require.False(t, info.NextProcessAt.Before(before.Add(time.Hour)),
		"asynq would run the job at %s, before enqueue + delay %s", info.NextProcessAt, before.Add(time.Hour))
}

func mustJSON(t testing.TB, v any) []byte {
	t.Helper()
	b, err := json.Marshal(v)
	require.NoError(t, err)
	return b
}

// A task without a payload (asynq allows one) is enqueued by every method,
// and its job keeps an empty payload.
func TestEnqueueWithoutPayload(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	var ids []string
	res, err := b.client.Enqueue(ctx, tasks.NewRaw("test:empty", nil, "empty-1"))
	require.NoError(t, err)
	ids = append(ids, res.Job.ID)
	require.NoError(t, pgx.BeginFunc(ctx, b.pool, func(tx pgx.Tx) error {
		res, err := b.client.EnqueueTx(ctx, tx, tasks.NewRaw("test:empty", nil, "empty-2"))
		if err == nil {
			ids = append(ids, res.Job.ID)
		}
		return err
	}))
	many, err := b.client.EnqueueMany(ctx, tasks.NewRaw("test:empty", nil, "empty-3"))
	require.NoError(t, err)
	ids = append(ids, many[0].Job.ID)
	for _, id := range ids {
		j, err := b.store.Get(ctx, id)
		require.NoError(t, err)
		require.Empty(t, j.Payload)
	}
}

// asynq keeps a task's timeout in whole seconds: a timeout that is not one is
// rounded up, never down — 800 ms truncated to 0 would be no timeout at all
// (asynq's 30 minutes), and 1.9 s would cut the handler off at 1 s.
func TestATimeoutIsRoundedUpToWholeSeconds(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	for i, c := range []struct{ timeout, asynq time.Duration }{
		{800 * time.Millisecond, time.Second},
		{1900 * time.Millisecond, 2 * time.Second},
		{3 * time.Second, 3 * time.Second},
	} {
		res, err := b.client.Enqueue(ctx, sendReceipt.New(receipt{OrderID: fmt.Sprint("timeout-", i)}, tasks.Timeout(c.timeout)))
		require.NoError(t, err)
		require.Equal(t, c.timeout, res.Job.Timeout, "the ledger keeps the timeout given")
		info, err := b.insp.GetTaskInfo(res.Job.Queue, res.Job.ID)
		require.NoError(t, err)
		require.Equal(t, c.asynq, info.Timeout, "Timeout(%s) in asynq", c.timeout)
	}
}
