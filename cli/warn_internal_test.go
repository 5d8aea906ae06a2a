package cli

import (
	"bytes"
	"context"
	"log/slog"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/tasks"
)

type warnPayload struct {
	ID string `json:"id"`
}

// A declared kind whose queue the worker reads but that has no handler is
// named at start; one on a queue the worker does not read is not.
func TestWorkerWarnsOfDeclaredKindsWithoutHandler(t *testing.T) {
	key := tasks.Key(func(p warnPayload) string { return p.ID })
	handled := tasks.Define[warnPayload]("warn:handled", key)
	forgotten := tasks.Define[warnPayload]("warn:forgotten", key)
	elsewhere := tasks.Define[warnPayload]("warn:elsewhere", tasks.Queue("reports"), key)
	mux := tasks.NewMux()
	tasks.Handle(mux, handled, func(context.Context, warnPayload) error { return nil })

	var buf bytes.Buffer
	log := slog.New(slog.NewTextHandler(&buf, nil))
	warnUnhandled(log, tasks.NewKinds(handled, forgotten, elsewhere), mux, map[string]int{"default": 1})
	out := buf.String()
	require.Contains(t, out, "kind=warn:forgotten")
	require.NotContains(t, out, "warn:handled")
	require.NotContains(t, out, "warn:elsewhere", "a worker that does not read the kind's queue needs no handler for it")
}
