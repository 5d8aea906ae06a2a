package cli_test

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/tasks"
)

var fairGreet = tasks.Define[Greeting]("greet:fair",
	tasks.Key(func(g Greeting) string { return g.Name }),
	tasks.ConcurrencyKey(func(g Greeting) string { return g.Name[:1] }, 1))

// `keys ls` shows each key's jobs in flight and held, as text and JSON.
func TestKeysLs(t *testing.T) {
	e := setup(t)
	ctx := context.Background()
	client, err := tasks.NewClient(tasks.ClientConfig{Redis: e.redis, Pool: e.pool})
	require.NoError(t, err)
	defer client.Close()
	var last *tasks.Result
	for i := range 3 {
		last, err = client.Enqueue(ctx, fairGreet.New(Greeting{Name: fmt.Sprint("a", i)}))
		require.NoError(t, err)
	}
	_, err = client.Enqueue(ctx, fairGreet.New(Greeting{Name: "b0"}))
	require.NoError(t, err)

	out, _, err := e.greeter(t, "", "keys", "ls", "--kind", fairGreet.Name())
	require.NoError(t, err)
	require.Regexp(t, `KEY\s+LIMIT\s+IN FLIGHT\s+RUNNING\s+HELD\s+OLDEST HELD\n`, out)
	require.Regexp(t, `\na\s+1\s+1\s+0\s+2\s+\d+s ago\nb\s+1\s+1\s+0\s+0\s+-\n`, out)

	out, _, err = e.greeter(t, "", "keys", "ls", "--kind", fairGreet.Name(), "--key", "a", "--json")
	require.NoError(t, err)
	var rows []struct {
		Key      string `json:"key"`
		InFlight int    `json:"in_flight"`
		Held     int    `json:"held"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &rows))
	require.Equal(t, 1, len(rows))
	require.Equal(t, "a", rows[0].Key)
	require.Equal(t, []int{1, 2}, []int{rows[0].InFlight, rows[0].Held})

	_, _, err = e.greeter(t, "", "keys", "ls")
	require.ErrorContains(t, err, "--kind")

	// A held job's status says so.
	out, _, err = e.greeter(t, "", "status", "--id", last.Job.ID)
	require.NoError(t, err)
	require.Regexp(t, `concurrency key\s+a\n`, out)
	require.Regexp(t, `held\s+since \S+: waiting for a slot of its concurrency key`, out)
	out, _, err = e.greeter(t, "", "status", "--id", last.Job.ID, "--json")
	require.NoError(t, err)
	var st struct {
		Key  string  `json:"concurrency_key"`
		Held *string `json:"key_held_since"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &st))
	require.Equal(t, "a", st.Key)
	require.NotNil(t, st.Held)
}
