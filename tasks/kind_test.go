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

	// A raw task of a kind of the set goes to that kind's queue.
	raw := tasks.NewKinds(sendReceipt).NewRaw("test:send_receipt", []byte(`{"order_id":"8"}`), "order:8")
	require.Equal(t, "critical", raw.Queue())
	require.Equal(t, "order:8", raw.BusinessKey())
	require.Equal(t, tasks.DefaultQueue, tasks.NewKinds(sendReceipt).NewRaw("test:undeclared", nil, "k").Queue())
}
