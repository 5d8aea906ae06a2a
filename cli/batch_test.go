package cli_test

import (
	"context"
	"encoding/json"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/tasks"
)

// `batch ls` and `batch show` in a program's own binary.
func TestBatchCommands(t *testing.T) {
	e := setup(t)
	redis, pool := e.redis, e.pool
	env := []string{"REDIS_URL=" + e.redisURL(), "DATABASE_URL=" + e.databaseURL()}
	ctx := context.Background()
	client, err := tasks.NewClient(tasks.ClientConfig{Redis: redis, Pool: pool})
	require.NoError(t, err)
	defer client.Close()

	batch, err := client.NewBatch(ctx, tasks.BatchSpec{Description: "welcome wave 1",
		OnComplete: tasks.NewRaw("welcome:wave_done", []byte(`{"wave":1}`), "")})
	require.NoError(t, err)
	var ids []string
	for _, u := range []string{"1", "2", "3"} {
		r, err := client.Enqueue(ctx, tasks.NewRaw("user:send_welcome", []byte(`{"user_id":"`+u+`"}`), "user:"+u, tasks.InBatch(batch.ID)))
		require.NoError(t, err)
		ids = append(ids, r.Job.ID)
	}
	_, err = pool.Exec(ctx, `UPDATE keel_jobs SET status = 'succeeded', finished_at = now() WHERE id = $1`, ids[0])
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `UPDATE keel_jobs SET status = 'dead', finished_at = now(), last_error = 'mailbox full' WHERE id = $1`, ids[1])
	require.NoError(t, err)
	_, err = client.SealBatch(ctx, batch.ID)
	require.NoError(t, err)

	r := welcome(t, env, "batch", "show", batch.ID)
	require.Equal(t, 0, r.code, r.stderr)
	require.Regexp(t, `state\s+sealed\n`, r.stdout)
	require.Regexp(t, `ended\s+2 of 3: 1 succeeded, 1 dead, 0 discarded, 0 cancelled\n`, r.stdout)
	require.Regexp(t, `open\s+1: 1 pending, 0 running, 0 failed`, r.stdout)
	require.Regexp(t, `on complete\s+welcome:wave_done \(queue default\): not enqueued yet\n`, r.stdout)
	require.Contains(t, r.stdout, ids[2], "the open member is listed")
	require.NotContains(t, r.stdout, ids[0])
	// A member waiting (for its parents, or held by its key) is open too.
	_, err = pool.Exec(ctx, `UPDATE keel_jobs SET status = 'waiting' WHERE id = $1`, ids[2])
	require.NoError(t, err)
	r = welcome(t, env, "batch", "show", batch.ID)
	require.Equal(t, 0, r.code, r.stderr)
	require.Regexp(t, `open\s+1: 0 pending, 0 running, 0 failed \(will retry\), 1 waiting, 0 paused\n`, r.stdout)
	require.Contains(t, r.stdout, ids[2], "the waiting member is listed")
	_, err = pool.Exec(ctx, `UPDATE keel_jobs SET status = 'pending' WHERE id = $1`, ids[2])
	require.NoError(t, err)

	// The last member ends: the callback is enqueued; JSON shows it.
	_, err = pool.Exec(ctx, `UPDATE keel_jobs SET status = 'succeeded', finished_at = now() WHERE id = $1`, ids[2])
	require.NoError(t, err)
	r = welcome(t, env, "batch", "show", batch.ID, "--json")
	require.Equal(t, 0, r.code, r.stderr)
	var show struct {
		State     string
		Total     int
		Succeeded int
		Dead      int
		Callbacks []struct {
			Event  string
			Kind   string
			JobID  string `json:"job_id"`
			Status string
		}
		OpenMembers []any `json:"open_members"`
	}
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &show))
	require.Equal(t, "complete", show.State)
	require.Equal(t, 3, show.Total)
	require.Equal(t, 2, show.Succeeded)
	require.Equal(t, 1, show.Dead)
	require.Empty(t, show.OpenMembers)
	require.Len(t, show.Callbacks, 1)
	require.Equal(t, "complete", show.Callbacks[0].Event)
	require.NotEmpty(t, show.Callbacks[0].JobID)
	require.Equal(t, "pending", show.Callbacks[0].Status)

	open, err := client.NewBatch(ctx, tasks.BatchSpec{Description: "still filling"})
	require.NoError(t, err)
	r = welcome(t, env, "batch", "ls")
	require.Equal(t, 0, r.code, r.stderr)
	require.Regexp(t, open.ID+`\s+open\s+0/0`, r.stdout)
	require.Regexp(t, batch.ID+`\s+complete\s+3/3\s+2\s+1`, r.stdout)
	r = welcome(t, env, "batch", "ls", "--open", "--json")
	require.Equal(t, 0, r.code, r.stderr)
	var ls struct{ Batches []struct{ ID string } }
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &ls))
	require.Len(t, ls.Batches, 1)
	require.Equal(t, open.ID, ls.Batches[0].ID)

	for _, c := range []struct {
		args []string
		code int
		want string
	}{
		{[]string{"batch", "show", "nope"}, 2, `batch id "nope" is malformed`},
		{[]string{"batch", "show", "01936f3e-8c1a-7b2e-9f00-1a2b3c4d5e6f"}, 1, "no batch with id 01936f3e-8c1a-7b2e-9f00-1a2b3c4d5e6f"},
		{[]string{"batch", "ls", "--limit", "0"}, 2, "--limit 0"},
	} {
		r := welcome(t, env, c.args...)
		require.Equal(t, c.code, r.code, "%v: %s", c.args, r.stderr)
		require.Equal(t, 1, strings.Count(r.stderr, "\n"), "%v: one line, got:\n%s", c.args, r.stderr)
		require.Contains(t, r.stderr, c.want, "%v", c.args)
	}
}

// batch show keeps a batch's description on its row: one typed with a line
// break "state  complete" must not show an open batch as complete.
func TestBatchShowKeepsTheDescriptionOnItsRow(t *testing.T) {
	e := setup(t)
	redis, pool := e.redis, e.pool
	ctx := context.Background()
	client, err := tasks.NewClient(tasks.ClientConfig{Redis: redis, Pool: pool})
	require.NoError(t, err)
	defer client.Close()
	batch, err := client.NewBatch(ctx, tasks.BatchSpec{Description: "wave 2\nstate        complete"})
	require.NoError(t, err)
	_, err = client.Enqueue(ctx, tasks.NewRaw("odd\nkind", []byte(`{}`), "k1", tasks.InBatch(batch.ID)))
	require.NoError(t, err)
	out, _, err := e.greeter(t, "", "batch", "show", batch.ID)
	require.NoError(t, err)
	var states []string
	for _, line := range strings.Split(out, "\n") {
		if strings.HasPrefix(line, "state") {
			states = append(states, line)
		}
		require.False(t, strings.HasPrefix(line, "kind"), "%q", out)
	}
	require.Len(t, states, 1, out)
	require.Regexp(t, `^state +open$`, states[0])
}
