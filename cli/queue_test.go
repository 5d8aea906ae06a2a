package cli_test

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/hibiken/asynq"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/tasks"
)

// `queue pause` and `resume` as an operator runs them, and `queue ls`
// saying who paused what, and what asynq's own tools paused.
func TestQueueCommands(t *testing.T) {
	e := setup(t)
	ctx := context.Background()
	client, err := tasks.NewClient(tasks.ClientConfig{Redis: e.redis, Pool: e.pool})
	require.NoError(t, err)
	defer client.Close()
	ada, err := client.Enqueue(ctx, Greet.New(Greeting{Name: "ada"}))
	require.NoError(t, err)
	_, err = client.Enqueue(ctx, Greet.New(Greeting{Name: "bo"}, tasks.Queue("low")))
	require.NoError(t, err)
	insp := asynq.NewInspector(e.redis)
	defer insp.Close()

	out, _, err := e.greeter(t, "", "queue", "pause", "default", "--actor", "ops:ann", "--note", "supplier outage")
	require.NoError(t, err)
	require.Equal(t, "queue default: paused\n", out)
	info, err := insp.GetQueueInfo("default")
	require.NoError(t, err)
	require.True(t, info.Paused)
	out, _, err = e.greeter(t, "", "queue", "pause", "default")
	require.NoError(t, err)
	require.Equal(t, "queue default: paused already\n", out)
	require.NoError(t, insp.PauseQueue("low")) // asynq's own tools
	// A job Redis delivered while it had lost the pause, held at its claim.
	held, err := client.Enqueue(ctx, Greet.New(Greeting{Name: "cy"}))
	require.NoError(t, err)
	_, err = e.pool.Exec(ctx, `UPDATE keel_jobs SET status = 'paused' WHERE id = $1`, held.Job.ID)
	require.NoError(t, err)

	out, _, err = e.greeter(t, "", "queue", "ls")
	require.NoError(t, err)
	require.Regexp(t, `QUEUE\s+PENDING\s+ACTIVE\s+SCHEDULED\s+RETRY\s+PAUSED\n`, out)
	require.Regexp(t, `default\s+2\s+0\s+0\s+0\s+by ops:ann \S+: supplier outage \(and 1 held in the ledger\)\n`, out)
	require.Regexp(t, `low\s+1\s+0\s+0\s+0\s+in Redis only`, out)
	out, _, err = e.greeter(t, "", "queue", "ls", "--json")
	require.NoError(t, err)
	var rows []struct {
		Queue     string `json:"queue"`
		Paused    bool   `json:"paused"`
		PausedBy  string `json:"paused_by"`
		RedisOnly bool   `json:"paused_in_redis_only"`
		Held      int64  `json:"held"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &rows))
	require.Len(t, rows, 2)
	require.True(t, rows[0].Paused)
	require.Equal(t, "ops:ann", rows[0].PausedBy)
	require.Equal(t, int64(1), rows[0].Held)
	require.True(t, rows[1].RedisOnly)

	// keel status says which pause holds the job, and how to lift it.
	out, _, err = e.greeter(t, "", "status", "--id", held.Job.ID)
	require.NoError(t, err)
	require.Regexp(t, `held\s+its queue default is paused, and Redis, which had lost the pause, delivered it: `+
		`no worker starts it until the queue resumes \(greeter queue resume default\)`, out)
	heldBy := func() []string {
		out, _, err := e.greeter(t, "", "status", "--id", held.Job.ID, "--json")
		require.NoError(t, err)
		var sj struct {
			HeldBy []string `json:"held_by"`
		}
		require.NoError(t, json.Unmarshal([]byte(out), &sj), out)
		return sj.HeldBy
	}
	require.Equal(t, []string{"queue"}, heldBy())

	out, _, err = e.greeter(t, "", "queue", "resume", "default", "--json")
	require.NoError(t, err)
	require.JSONEq(t, `{"queue": "default", "action": "resume", "changed": true}`, out)
	info, err = insp.GetQueueInfo("default")
	require.NoError(t, err)
	require.False(t, info.Paused)
	var st string
	require.NoError(t, e.pool.QueryRow(ctx, `SELECT status FROM keel_jobs WHERE id = $1`, held.Job.ID).Scan(&st))
	require.Equal(t, "pending", st, "the resume released the held job")
	require.NoError(t, e.pool.QueryRow(ctx, `SELECT status FROM keel_jobs WHERE id = $1`, ada.Job.ID).Scan(&st))
	require.Equal(t, "pending", st)
	// Held for its kind's pause (the kind's resume releases it).
	_, _, err = e.greeter(t, "", "kind", "pause", Greet.Name())
	require.NoError(t, err)
	_, err = e.pool.Exec(ctx, `UPDATE keel_jobs SET status = 'paused' WHERE id = $1`, held.Job.ID)
	require.NoError(t, err)
	require.Equal(t, []string{"kind"}, heldBy())
	out, _, err = e.greeter(t, "", "status", "--id", held.Job.ID)
	require.NoError(t, err)
	require.Regexp(t, `held\s+its kind `+Greet.Name()+` is paused: no worker starts it until the kind resumes \(greeter kind resume `+Greet.Name()+`\)`, out)
	// Held with neither pause standing (a pause row removed by hand).
	_, err = e.pool.Exec(ctx, `DELETE FROM keel_kind_pauses`)
	require.NoError(t, err)
	require.Equal(t, []string{}, heldBy(), "an empty list, not an absent field")
	out, _, err = e.greeter(t, "", "status", "--id", held.Job.ID)
	require.NoError(t, err)
	require.Contains(t, out, "neither its kind "+Greet.Name()+" nor its queue default is paused any more")

	_, _, err = e.greeter(t, "", "queue", "pause", "no such queue!")
	require.ErrorContains(t, err, "queue")
}
