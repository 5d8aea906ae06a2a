package cli_test

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/testenv"
	"github.com/keeljobs/keel/internal/testworker"
	"github.com/keeljobs/keel/server"
	"github.com/keeljobs/keel/tasks"
)

// `status` shows what a running job's handler reported, and what a
// succeeded one stored as its result; --json has both.
func TestStatusShowsProgressAndResult(t *testing.T) {
	e := setup(t)
	reported := make(chan struct{})
	finish := make(chan struct{})
	mux := tasks.NewMux()
	tasks.Handle(mux, Greet, func(ctx context.Context, g Greeting) error {
		if err := idempotency.Progress(ctx, 3, 12, "greeting "+g.Name); err != nil {
			return err
		}
		close(reported)
		<-finish
		return idempotency.SetResult(ctx, map[string]any{"greeted": g.Name, "words": 2})
	})
	defer func() {
		select {
		case <-finish:
		default:
			close(finish)
		}
	}()
	testworker.RunServer(t, server.Config{Redis: e.redis, Pool: e.pool, Concurrency: 2, ShutdownTimeout: time.Second}, mux)
	j := e.enqueueGreet(t, "ada")
	<-reported

	type statusOut struct {
		Status   string `json:"status"`
		Progress *struct {
			Done  int64  `json:"done"`
			Total int64  `json:"total"`
			Note  string `json:"note"`
			Run   int    `json:"run"`
		} `json:"progress"`
		Result json.RawMessage `json:"result"`
	}
	status := func() statusOut {
		out, _, err := e.greeter(t, "", "status", "--id", j.ID, "--json")
		require.NoError(t, err)
		var st statusOut
		require.NoError(t, json.Unmarshal([]byte(out), &st), out)
		return st
	}
	st := status()
	require.Equal(t, "running", st.Status)
	require.NotNil(t, st.Progress, "the first report is written at once")
	require.Equal(t, int64(3), st.Progress.Done)
	require.Equal(t, int64(12), st.Progress.Total)
	require.Equal(t, "greeting ada", st.Progress.Note)
	require.Equal(t, 1, st.Progress.Run)
	require.Nil(t, st.Result)
	out, _, err := e.greeter(t, "", "status", "cli:greet", "greet:ada")
	require.NoError(t, err)
	require.Regexp(t, `progress\s+3/12 \(25%\) greeting ada \(reported `, out)
	require.NotContains(t, out, "result")

	close(finish)
	testenv.Eventually(t, 20*time.Second, func() bool { return status().Status == "succeeded" }, "the job never succeeded")
	st = status()
	require.JSONEq(t, `{"greeted": "ada", "words": 2}`, string(st.Result))
	require.NotNil(t, st.Progress, "the last report stays with the job")
	out, _, err = e.greeter(t, "", "status", "--id", j.ID)
	require.NoError(t, err)
	require.Regexp(t, `progress\s+3/12 \(25%\) greeting ada \(last reported `, out)
	require.Regexp(t, `result\s+\{"greeted":"ada","words":2\}`, out)
}

// `dead show` says how far the dead job's last run got, as status does.
func TestDeadShowSaysHowFarTheLastRunGot(t *testing.T) {
	e := setup(t)
	ctx := context.Background()
	j := e.enqueueGreet(t, "bob")
	_, err := e.pool.Exec(ctx, `UPDATE keel_jobs SET status = 'dead', error_class = 'permanent', last_error = 'boom', finished_at = now() WHERE id = $1`, j.ID)
	require.NoError(t, err)
	_, err = e.pool.Exec(ctx, `INSERT INTO keel_job_progress (job_id, run, done, total, note) VALUES ($1, 1, 7, 10, 'sending')`, j.ID)
	require.NoError(t, err)
	out, _, err := e.greeter(t, "", "dead", "show", j.ID)
	require.NoError(t, err)
	require.Regexp(t, `progress\s+7/10 \(70%\) sending \(last reported `, out)
	out, _, err = e.greeter(t, "", "dead", "show", j.ID, "--json")
	require.NoError(t, err)
	require.Regexp(t, `"progress": \{\s+"done": 7,\s+"total": 10,\s+"note": "sending",\s+"run": 1`, out)
}
