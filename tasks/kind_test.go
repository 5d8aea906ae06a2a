package tasks_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/retry"
	"github.com/keeljobs/keel/tasks"
)

func panicMessage(fn func()) (msg string) {
	defer func() { msg = fmt.Sprint(recover()) }()
	fn()
	return "<no panic>"
}

func TestDefinePanicsOnMistakes(t *testing.T) {
	require.Contains(t, panicMessage(func() {
		tasks.Define[receipt]("", tasks.Key(func(r receipt) string { return r.OrderID }))
	}), "empty kind name")

	msg := panicMessage(func() { tasks.Define[receipt]("test:no_key") })
	require.Contains(t, msg, `"test:no_key"`)
	require.Contains(t, msg, "Key")
	require.False(t, tasks.Known("test:no_key"), "a kind that failed to define must not be registered")

	// A Key for another payload type is no Key for this kind.
	msg = panicMessage(func() {
		tasks.Define[receipt]("test:wrong_key", tasks.Key(func(s string) string { return s }))
	})
	require.Contains(t, msg, `"test:wrong_key"`)
	require.Contains(t, msg, "tasks.Key[string]")

	// A Summary for another payload type would be ignored: refused.
	msg = panicMessage(func() {
		tasks.Define[receipt]("test:wrong_summary", tasks.Key(func(r receipt) string { return r.OrderID }),
			tasks.Summary(func(s string) string { return s }))
	})
	require.Contains(t, msg, `"test:wrong_summary"`)
	require.Contains(t, msg, "tasks.Summary[string]")
	require.False(t, tasks.Known("test:wrong_summary"))
}

// Key and Summary concern a whole kind: New and NewRaw refuse them (at
// enqueue) instead of ignoring them.
func TestNewRefusesKindOptions(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	for _, task := range []*tasks.Task{
		sendReceipt.New(receipt{OrderID: "1"}, tasks.Key(func(r receipt) string { return "other:" + r.OrderID })),
		sendReceipt.New(receipt{OrderID: "1"}, tasks.Summary(func(receipt) string { return "redacted" })),
		tasks.NewRaw("test:send_receipt", []byte(`{}`), "k", tasks.Key(func(r receipt) string { return r.OrderID })),
	} {
		_, err := b.client.Enqueue(ctx, task)
		require.ErrorIs(t, err, tasks.ErrInvalidTask)
		require.ErrorContains(t, err, "test:send_receipt")
		require.ErrorContains(t, err, "tasks.Define")
		require.ErrorContains(t, err, "tasks.BusinessKey")
	}
	require.Equal(t, 0, b.count(t, `SELECT count(*) FROM keel_jobs`))
}

func TestDecodeMalformedPayloadIsPermanent(t *testing.T) {
	for _, payload := range []string{`{not json`, `{"order_id": 5}`, ``} {
		_, err := sendReceipt.Decode([]byte(payload))
		require.Error(t, err, "payload %q", payload)
		require.ErrorIs(t, err, retry.ErrPermanent, "payload %q", payload)
		require.Equal(t, retry.ClassPermanent, retry.Classify(err))
		require.ErrorContains(t, err, "test:send_receipt")
	}
	r, err := sendReceipt.Decode([]byte(`{"order_id":"7"}`))
	require.NoError(t, err)
	require.Equal(t, receipt{OrderID: "7"}, r)
}

func TestTaskTakesKindDefaultsAndItsOwnOptions(t *testing.T) {
	require.Equal(t, "test:send_receipt", sendReceipt.Name())
	require.Equal(t, "critical", sendReceipt.Queue())
	require.Equal(t, tasks.DefaultQueue, keyedKind.Queue())
	require.True(t, tasks.Known("test:send_receipt"))

	d := sendReceipt.New(receipt{OrderID: "7"})
	require.Equal(t, "test:send_receipt", d.Kind())
	require.Equal(t, "order:7", d.BusinessKey())
	require.Equal(t, "critical", d.Queue())
	require.JSONEq(t, `{"order_id":"7"}`, string(d.Payload()))
	now := time.Now()
	require.True(t, d.RunAt(now).IsZero())

	o := sendReceipt.New(receipt{OrderID: "7"}, tasks.Queue("low"), tasks.BusinessKey("custom"), tasks.Delay(time.Minute))
	require.Equal(t, "low", o.Queue())
	require.Equal(t, "custom", o.BusinessKey())
	require.Equal(t, now.Add(time.Minute), o.RunAt(now))
	at := now.Add(time.Hour)
	require.Equal(t, at, sendReceipt.New(receipt{}, tasks.ProcessAt(at)).RunAt(now))

	// A raw task of a declared kind goes to that kind's queue.
	raw := tasks.NewRaw("test:send_receipt", []byte(`{"order_id":"8"}`), "order:8")
	require.Equal(t, "critical", raw.Queue())
	require.Equal(t, "order:8", raw.BusinessKey())
	require.Equal(t, tasks.DefaultQueue, tasks.NewRaw("test:undeclared", nil, "k").Queue())
}

func TestSummarize(t *testing.T) {
	type card struct {
		Number string `json:"number"`
	}
	tasks.Define[card]("test:card", tasks.Key(func(c card) string { return c.Number }),
		tasks.Summary(func(c card) string { return "card ending " + c.Number[len(c.Number)-4:] }))
	require.Equal(t, "card ending 4242", tasks.Summarize("test:card", []byte(`{"number":"4242424242424242"}`)))
	require.Equal(t, "(payload does not decode)", tasks.Summarize("test:card", []byte(`{`)))

	long := make([]byte, 600)
	for i := range long {
		long[i] = 'x'
	}
	require.Len(t, tasks.Summarize("test:no_summary", long), 512)
}

func TestNewRawAppliesTheKindsDefaults(t *testing.T) {
	k := tasks.Define[struct{}]("tasks-test:raw-defaults", tasks.Queue("low"), tasks.MaxRetry(3),
		tasks.Key(func(struct{}) string { return "k" }))
	raw := tasks.NewRaw(k.Name(), []byte(`{}`), "k")
	require.Equal(t, "low", raw.Queue())
	override := tasks.NewRaw(k.Name(), []byte(`{}`), "k", tasks.Queue("critical"))
	require.Equal(t, "critical", override.Queue())

	b := setup(t)
	res, err := b.client.Enqueue(context.Background(), raw)
	require.NoError(t, err)
	require.Equal(t, 3, res.Job.MaxRetry, "the kind's retry budget must apply to raw tasks")
}
