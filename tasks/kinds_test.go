package tasks_test

import (
	"context"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/tasks"
)

type card struct {
	Number string `json:"number"`
}

var chargeCard = tasks.Define[card]("test:card", tasks.Key(func(c card) string { return c.Number }),
	tasks.Summary(func(c card) string { return "card ending " + c.Number[len(c.Number)-4:] }))

// Defining a kind makes it known to no set but those built with it: two
// programs, or two tests, in one process do not see each other's kinds.
func TestAKindIsKnownOnlyToTheSetsThatHoldIt(t *testing.T) {
	mine := tasks.NewKinds(sendReceipt)
	require.True(t, mine.Known("test:send_receipt"))
	require.False(t, mine.Known("test:card"), "defined in this process, but not one of this set's")
	require.Equal(t, `{"number":"4242424242424242"}`, mine.Summarize("test:card", []byte(`{"number":"4242424242424242"}`)),
		"another set's Summary")
	var none *tasks.Kinds
	require.False(t, none.Known("test:send_receipt"))
	require.Empty(t, none.All())
	require.Equal(t, tasks.DefaultQueue, none.NewRaw("test:send_receipt", nil, "k").Queue())
	require.Equal(t, tasks.DefaultQueue, tasks.NewRaw("test:send_receipt", nil, "k").Queue(), "tasks.NewRaw takes no kind's defaults")
}

func TestNewKindsRefusesTwoKindsOfOneName(t *testing.T) {
	again := tasks.Define[card]("test:card", tasks.Key(func(c card) string { return c.Number }))
	require.Contains(t, panicMessage(func() { tasks.NewKinds(chargeCard, again) }), `"test:card"`)
	require.Len(t, tasks.NewKinds(chargeCard, chargeCard, sendReceipt).All(), 2, "one kind given twice is one kind")
	names := []string{}
	for _, k := range tasks.NewKinds(sendReceipt, chargeCard).All() {
		names = append(names, k.Name())
	}
	require.Equal(t, []string{"test:card", "test:send_receipt"}, names)
}

func TestSummarize(t *testing.T) {
	ks := tasks.NewKinds(chargeCard)
	require.Equal(t, "card ending 4242", ks.Summarize("test:card", []byte(`{"number":"4242424242424242"}`)))
	require.Equal(t, "(payload does not decode)", ks.Summarize("test:card", []byte(`{`)))
	require.Contains(t, ks.Summarize("test:card", []byte(`{"number":"42"}`)), "Summary panicked",
		"a Summary's bug gives a note, not the payload it was there to redact")

	long := []byte(strings.Repeat("x", 600))
	require.Len(t, ks.Summarize("test:no_summary", long), 512)
	require.Len(t, (*tasks.Kinds)(nil).Summarize("test:card", long), 512)
}

func TestNewRawAppliesTheKindsDefaults(t *testing.T) {
	k := tasks.Define[struct{}]("tasks-test:raw-defaults", tasks.Queue("low"), tasks.MaxRetry(3),
		tasks.Key(func(struct{}) string { return "k" }))
	ks := tasks.NewKinds(k)
	raw := ks.NewRaw(k.Name(), []byte(`{}`), "k")
	require.Equal(t, "low", raw.Queue())
	override := ks.NewRaw(k.Name(), []byte(`{}`), "k", tasks.Queue("critical"))
	require.Equal(t, "critical", override.Queue())

	b := setup(t)
	res, err := b.client.Enqueue(context.Background(), raw)
	require.NoError(t, err)
	require.Equal(t, 3, res.Job.MaxRetry, "the kind's retry budget must apply to raw tasks")
}

func TestNewJSONDecodesIntoTheKindsType(t *testing.T) {
	ks := tasks.NewKinds(sendReceipt)
	task, err := ks.NewJSON("test:send_receipt", []byte(`{"order_id":"9"}`))
	require.NoError(t, err)
	require.Equal(t, "order:9", task.BusinessKey())
	require.Equal(t, "critical", task.Queue())
	task, err = ks.NewJSON("test:send_receipt", []byte(`{"order_id":"9"}`), tasks.BusinessKey("mine"))
	require.NoError(t, err)
	require.Equal(t, "mine", task.BusinessKey())
	for _, bad := range []string{`{"order":"9"}`, `{"order_id":9}`, `{} {}`, `{`} {
		_, err = ks.NewJSON("test:send_receipt", []byte(bad))
		require.ErrorContains(t, err, "does not decode", bad)
	}
	_, err = ks.NewJSON("test:card", []byte(`{}`))
	require.ErrorContains(t, err, `"test:card"`)
}

func TestMuxDeclaresTheKindsItHandles(t *testing.T) {
	mux := tasks.NewMux()
	tasks.Handle(mux, chargeCard, func(context.Context, card) error { return nil })
	mux.HandleTask("test:untyped", tasks.NewMux())
	require.True(t, mux.Declared().Known("test:card"))
	require.False(t, mux.Declared().Known("test:untyped"), "an untyped handler has no kind's Summary")
	require.False(t, mux.Declared().Known("test:send_receipt"))
}

// A JSON payload whose text would change on decoding — bytes that are not
// UTF-8, an escaped lone surrogate — gives the key of another payload
// ("order:\uFFFD" for both of two orders): two actions would be one job.
func TestJSONKindsRefuseTextThatDecodingWouldChange(t *testing.T) {
	ks := tasks.NewKinds(sendReceipt)
	for _, bad := range []string{"{\"order_id\":\"\xff\"}", "{\"order_id\":\"\xfe\"}", `{"order_id":"\ud800"}`,
		`{"order_id":"\udc00x"}`, `{"order_id":"a\ud800\u0041"}`} {
		_, err := ks.NewJSON("test:send_receipt", []byte(bad))
		require.ErrorIs(t, err, tasks.ErrInvalidTask, "%q", bad)
		require.ErrorContains(t, err, "UTF-8", "%q", bad)
		require.ErrorIs(t, tasks.CheckTasks(nil, ks.NewRaw("test:send_receipt", []byte(bad), "order:1")), tasks.ErrInvalidTask,
			"a declared kind's raw payload, %q", bad)
	}
	for _, good := range []string{`{"order_id":"\ud83d\ude80"}`, `{"order_id":"\ufffd"}`, "{\"order_id\":\"\ufffd é\"}",
		`{"order_id":"\\ud800"}`} {
		task, err := ks.NewJSON("test:send_receipt", []byte(good))
		require.NoError(t, err, good)
		require.NoError(t, tasks.CheckTasks(nil, task), good)
		require.NoError(t, tasks.CheckTasks(nil, ks.NewRaw("test:send_receipt", []byte(good), "order:1")), good)
	}
	// A kind the set does not declare keeps its payload's bytes as given.
	require.NoError(t, tasks.CheckTasks(nil, tasks.NewRaw("test:opaque", []byte("\xff\x00"), "k")))
}
