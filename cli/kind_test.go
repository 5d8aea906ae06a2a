package cli_test

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/jobstore"
	"github.com/keeljobs/keel/tasks"
)

// `kind pause` holds the kind's waiting jobs, `kind ls` says who paused it
// and how many it holds, `kind resume` hands them back.
func TestKindCommands(t *testing.T) {
	e := setup(t)
	ctx := context.Background()
	client, err := tasks.NewClient(tasks.ClientConfig{Redis: e.redis, Pool: e.pool})
	require.NoError(t, err)
	defer client.Close()
	r, err := client.Enqueue(ctx, Greet.New(Greeting{Name: "ada"}))
	require.NoError(t, err)
	store := jobstore.NewStore(e.pool)

	out, _, err := e.greeter(t, "", "kind", "ls")
	require.NoError(t, err)
	require.Equal(t, "no kind is paused\n", out)
	out, _, err = e.greeter(t, "", "kind", "pause", "cli:greet", "--actor", "ops:ann", "--note", "supplier outage")
	require.NoError(t, err)
	require.Equal(t, "kind cli:greet: paused\n", out)
	j, err := store.Get(ctx, r.Job.ID)
	require.NoError(t, err)
	require.Equal(t, idempotency.StatusPaused, j.Status)
	out, _, err = e.greeter(t, "", "kind", "pause", "cli:greet")
	require.NoError(t, err)
	require.Equal(t, "kind cli:greet: paused already\n", out)

	out, _, err = e.greeter(t, "", "kind", "ls")
	require.NoError(t, err)
	require.Regexp(t, `KIND\s+HELD\s+PAUSED\ncli:greet\s+1\s+by ops:ann \S+: supplier outage\n`, out)
	out, _, err = e.greeter(t, "", "kind", "ls", "--json")
	require.NoError(t, err)
	var rows []struct {
		Kind     string `json:"kind"`
		PausedBy string `json:"paused_by"`
		Held     int64  `json:"held"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &rows))
	require.Len(t, rows, 1)
	require.Equal(t, "ops:ann", rows[0].PausedBy)
	require.Equal(t, int64(1), rows[0].Held)

	out, _, err = e.greeter(t, "", "kind", "resume", "cli:greet", "--json")
	require.NoError(t, err)
	require.JSONEq(t, `{"kind": "cli:greet", "action": "resume", "changed": true}`, out)
	j, err = store.Get(ctx, r.Job.ID)
	require.NoError(t, err)
	require.Equal(t, idempotency.StatusPending, j.Status)
	_, _, err = e.greeter(t, "", "kind", "pause", "cli:greet", "--actor", " ")
	require.Error(t, err)
}
