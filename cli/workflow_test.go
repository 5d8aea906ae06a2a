package cli_test

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/tasks"
)

// `status` says what a waiting job waits for and what waits for it,
// `workflow show` draws a workflow as a table, and `release` starts a
// waiting job by hand, audited.
func TestDependenciesFromTheCommandLine(t *testing.T) {
	e := setup(t)
	ctx := context.Background()
	client, err := tasks.NewClient(tasks.ClientConfig{Redis: e.redis, Pool: e.pool})
	require.NoError(t, err)
	defer client.Close()
	res, err := client.EnqueueWorkflow(ctx, tasks.NewWorkflow("onboarding-7").
		Add("hello", Greet.New(Greeting{Name: "ada"})).
		Add("follow-up", Greet.New(Greeting{Name: "ada-2"}), "hello"))
	require.NoError(t, err)
	parent, child := res.Tasks["hello"].Job, res.Tasks["follow-up"].Job

	out, _, err := e.greeter(t, "", "status", "--id", child.ID)
	require.NoError(t, err)
	require.Regexp(t, `status\s+waiting\n`, out)
	require.Regexp(t, `workflow\s+onboarding-7 \(task follow-up\): greeter workflow show onboarding-7\n`, out)
	require.Regexp(t, `after\s+`+parent.ID+` cli:greet/greet:ada \(pending: waited for\)\n`, out)
	out, _, err = e.greeter(t, "", "status", "--id", parent.ID)
	require.NoError(t, err)
	require.Regexp(t, `before\s+`+child.ID+` cli:greet/greet:ada-2 \(waiting\)\n`, out)

	out, _, err = e.greeter(t, "", "status", "--id", child.ID, "--json")
	require.NoError(t, err)
	var st struct {
		Status       string `json:"status"`
		Dependencies struct {
			WaitingOn int    `json:"waiting_on"`
			Workflow  string `json:"workflow"`
			Parents   []struct {
				ID     string `json:"id"`
				Status string `json:"status"`
			} `json:"parents"`
		} `json:"dependencies"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &st))
	require.Equal(t, "waiting", st.Status)
	require.Equal(t, 1, st.Dependencies.WaitingOn)
	require.Equal(t, "onboarding-7", st.Dependencies.Workflow)
	require.Len(t, st.Dependencies.Parents, 1)
	require.Equal(t, parent.ID, st.Dependencies.Parents[0].ID)

	out, _, err = e.greeter(t, "", "workflow", "show", "onboarding-7")
	require.NoError(t, err)
	require.Regexp(t, `TASK\s+STATUS\s+AFTER\s+JOB\s+KIND/KEY\n`, out)
	require.Regexp(t, `hello\s+pending\s+`+parent.ID, out)
	require.Regexp(t, `follow-up\s+waiting\s+hello\s+`+child.ID, out)
	out, _, err = e.greeter(t, "", "workflow", "show", "onboarding-7", "--json")
	require.NoError(t, err)
	var wf struct {
		Counts map[string]int `json:"counts"`
		Tasks  []struct {
			Task  string   `json:"task"`
			After []string `json:"after"`
		} `json:"tasks"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &wf))
	require.Equal(t, map[string]int{"pending": 1, "waiting": 1}, wf.Counts)
	require.Equal(t, []string{"hello"}, wf.Tasks[1].After)
	_, _, err = e.greeter(t, "", "workflow", "show", "nope")
	require.ErrorContains(t, err, `no workflow with id "nope"`)

	out, _, err = e.greeter(t, "", "release", child.ID, "--actor", "ops:bo", "--note", "greet anyway")
	require.NoError(t, err)
	require.Equal(t, child.ID+": released\n", out)
	out, _, err = e.greeter(t, "", "release", child.ID)
	require.NoError(t, err)
	require.Equal(t, child.ID+": not waiting (pending); left as it is\n", out)
	out, _, err = e.greeter(t, "", "dead", "show", child.ID)
	require.NoError(t, err)
	require.Contains(t, out, "release")
	require.Contains(t, out, "greet anyway")

	_, err = client.Cancel(ctx, parent.ID)
	require.NoError(t, err)
	_, _, err = e.greeter(t, "", "release", parent.ID)
	require.ErrorContains(t, err, "not waiting")
}

// `enqueue --after` makes a job that waits for others, as tasks.After
// does: it waits while a parent has not succeeded, and a parent that does
// not exist, or ended without succeeding, is refused with nothing written.
func TestEnqueueAfterFromTheCommandLine(t *testing.T) {
	e := setup(t)
	ctx := context.Background()
	client, err := tasks.NewClient(tasks.ClientConfig{Redis: e.redis, Pool: e.pool})
	require.NoError(t, err)
	defer client.Close()
	p1, err := client.Enqueue(ctx, Greet.New(Greeting{Name: "first"}))
	require.NoError(t, err)
	p2, err := client.Enqueue(ctx, Greet.New(Greeting{Name: "second"}))
	require.NoError(t, err)

	out, _, err := e.greeter(t, "", "enqueue", "cli:greet", "--payload", `{"name": "after-both"}`,
		"--after", p1.Job.ID, "--after", p2.Job.ID, "--json")
	require.NoError(t, err)
	var res struct {
		ID     string `json:"id"`
		Status string `json:"status"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &res))
	require.Equal(t, "waiting", res.Status)
	out, _, err = e.greeter(t, "", "status", "--id", res.ID)
	require.NoError(t, err)
	require.Contains(t, out, p1.Job.ID)
	require.Contains(t, out, p2.Job.ID)

	out, _, err = e.greeter(t, "", "enqueue", "cli:greet", "--payload", `{"name": "after-one"}`, "--after", p1.Job.ID)
	require.NoError(t, err)
	require.Regexp(t, `^job \S+ created \(status waiting, `, out)

	_, _, err = e.greeter(t, "", "enqueue", "cli:greet", "--payload", `{"name": "orphan"}`, "--after", "no-such-job")
	require.ErrorContains(t, err, "no-such-job")
	_, err = client.Cancel(ctx, p2.Job.ID)
	require.NoError(t, err)
	_, _, err = e.greeter(t, "", "enqueue", "cli:greet", "--payload", `{"name": "too-late"}`, "--after", p2.Job.ID)
	require.ErrorIs(t, err, tasks.ErrParentEnded)
	out, _, err = e.greeter(t, "", "status", "cli:greet", "greet:orphan")
	require.Error(t, err, "a refused job was written: %s", out)

	_, _, err = e.greeter(t, "", "enqueue", "--from", "-", "--after", p1.Job.ID)
	require.ErrorContains(t, err, "--from")
}

// A parent dead with its effects in (its handler failed after its
// completing InTx) met its child's dependency: `status` says so rather
// than telling a person to replay it, in text and JSON.
func TestStatusShowsADependencyMetByAParentDeadWithItsEffects(t *testing.T) {
	e := setup(t)
	ctx := context.Background()
	client, err := tasks.NewClient(tasks.ClientConfig{Redis: e.redis, Pool: e.pool})
	require.NoError(t, err)
	defer client.Close()
	p1, err := client.Enqueue(ctx, Greet.New(Greeting{Name: "printed"}))
	require.NoError(t, err)
	p2, err := client.Enqueue(ctx, Greet.New(Greeting{Name: "other"}))
	require.NoError(t, err)
	c, err := client.Enqueue(ctx, Greet.New(Greeting{Name: "after-both"}, tasks.After(p1.Job.ID, p2.Job.ID)))
	require.NoError(t, err)
	// p1's completing InTx commits (c is counted down), then its handler fails.
	_, err = e.pool.Exec(ctx, `UPDATE keel_jobs SET status = 'succeeded', finished_at = now() WHERE id = $1`, p1.Job.ID)
	require.NoError(t, err)
	_, err = e.pool.Exec(ctx, `UPDATE keel_jobs SET status = 'dead', effects_committed_at = finished_at WHERE id = $1`, p1.Job.ID)
	require.NoError(t, err)

	out, _, err := e.greeter(t, "", "status", "--id", c.Job.ID)
	require.NoError(t, err)
	require.Regexp(t, p1.Job.ID+` cli:greet/greet:printed \(dead: met, its completing InTx committed\)\n`, out)
	require.Regexp(t, p2.Job.ID+` cli:greet/greet:other \(pending: waited for\)\n`, out)
	require.NotContains(t, out, "dead replay "+p1.Job.ID)
	out, _, err = e.greeter(t, "", "status", "--id", c.Job.ID, "--json")
	require.NoError(t, err)
	var st struct {
		Dependencies struct {
			WaitingOn int `json:"waiting_on"`
			Parents   []struct {
				ID  string `json:"id"`
				Met bool   `json:"met"`
			} `json:"parents"`
		} `json:"dependencies"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &st))
	require.Equal(t, 1, st.Dependencies.WaitingOn)
	met := map[string]bool{}
	for _, p := range st.Dependencies.Parents {
		met[p.ID] = p.Met
	}
	require.Equal(t, map[string]bool{p1.Job.ID: true, p2.Job.ID: false}, met)
}
