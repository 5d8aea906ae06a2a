package inspect_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/inspect"
	"github.com/keeljobs/keel/tasks"
)

// AddSchedule and SetSchedule check an entry as a scheduler does, the
// payload against the limit every enqueue has; a change of an entry that
// is not there is ErrNotFound.
func TestScheduleChecks(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	payload := func(n int) []byte { return []byte(`"` + strings.Repeat("x", n-2) + `"`) }
	e := inspect.ScheduleEntry{Name: "big", Spec: "@hourly", Kind: "k", Payload: payload(tasks.MaxPayloadBytes + 1)}
	require.ErrorContains(t, b.ops.AddSchedule(ctx, e, "ops", ""), "bad payload")
	e.Payload = payload(tasks.MaxPayloadBytes)
	require.NoError(t, b.ops.AddSchedule(ctx, e, "ops", ""), "the limit is tasks.MaxPayloadBytes")

	for _, bad := range []inspect.ScheduleEntry{
		{Name: "big", Spec: "* * *", Kind: "k"},
		{Name: "big", Spec: "@hourly", Kind: "k", TimeZone: "Mars/Olympus"},
		{Name: "big", Spec: "@hourly", Kind: ""},
		{Name: "big", Spec: "@hourly", Kind: "k", Payload: []byte(`{`)},
		{Name: "big", Spec: "@hourly", Kind: "k", Timeout: 1500 * time.Microsecond},
	} {
		require.Error(t, b.ops.SetSchedule(ctx, bad, "ops", ""), "%+v", bad)
	}
	require.ErrorIs(t, b.ops.SetSchedule(ctx, inspect.ScheduleEntry{Name: "none", Spec: "@hourly", Kind: "k"}, "ops", ""), inspect.ErrNotFound)
	_, err := b.ops.PauseSchedule(ctx, "none", "ops", "")
	require.ErrorIs(t, err, inspect.ErrNotFound)
	changed, err := b.ops.ResumeSchedule(ctx, "big", "ops", "")
	require.NoError(t, err)
	require.False(t, changed, "not paused")

	known, err := inspect.New(inspect.Config{Pool: b.pool, KnownKind: func(k string) bool { return k == "k" }})
	require.NoError(t, err)
	defer known.Close()
	require.ErrorContains(t, known.AddSchedule(ctx, inspect.ScheduleEntry{Name: "other", Spec: "@hourly", Kind: "other"}, "ops", ""), "unknown kind")
}
