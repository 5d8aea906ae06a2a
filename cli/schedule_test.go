package cli_test

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/inspect"
	"github.com/keeljobs/keel/internal/testenv"
)

// `schedule add`, `set`, `pause`, `resume` and `rm` as an operator runs
// them, audited, and `schedule ls` showing the result.
func TestScheduleCommands(t *testing.T) {
	e := setup(t)
	ctx := context.Background()
	out, _, err := e.greeter(t, "", "schedule", "add", "greet-ada", "--spec", "0 2 * * *", "--timezone", "Europe/Berlin",
		"--kind", Greet.Name(), "--payload", `{"name":"ada"}`, "--max-retry", "2", "--timeout", "90s", "--actor", "ops:ann", "--note", "daily hello")
	require.NoError(t, err)
	require.Equal(t, "schedule entry greet-ada: added\n", out)
	_, _, err = e.greeter(t, "", "schedule", "add", "greet-ada", "--spec", "@hourly", "--kind", Greet.Name())
	require.ErrorIs(t, err, inspect.ErrScheduleExists)
	_, _, err = e.greeter(t, "", "schedule", "add", "bad", "--spec", "*/90 * * * *", "--kind", Greet.Name())
	require.ErrorContains(t, err, "@every")
	_, _, err = e.greeter(t, "", "schedule", "add", "bad", "--spec", "@hourly", "--kind", "no:such")
	require.ErrorContains(t, err, "unknown kind")
	_, _, err = e.greeter(t, "", "schedule", "add", "bad", "--spec", "@hourly", "--kind", Greet.Name(), "--payload", `{"name": 7}`)
	require.ErrorContains(t, err, "greet", "the payload must decode into the kind's type")
	_, _, err = e.greeter(t, "", "schedule", "add", "bad", "--spec", "@hourly")
	require.ErrorContains(t, err, "--spec and --kind are required")

	out, _, err = e.greeter(t, "", "schedule", "ls")
	require.NoError(t, err)
	require.Regexp(t, `ENTRY\s+SOURCE\s+SPEC\s+KIND\s+LAST TICK\s+LAST JOB\s+NEXT TICK\s+PAUSED\n`, out)
	require.Regexp(t, `greet-ada\s+ledger \(no scheduler runs it\)\s+0 2 \* \* \* \(Europe/Berlin\)\s+cli:greet\s+-\s+-\s+\S+T\S+\s+no\n`, out)

	out, _, err = e.greeter(t, "", "schedule", "set", "greet-ada", "--spec", "30 2 * * *", "--actor", "ops:bo", "--json")
	require.NoError(t, err)
	require.JSONEq(t, `{"entry": "greet-ada", "action": "set", "changed": true}`, out)
	out, _, err = e.greeter(t, "", "schedule", "pause", "greet-ada", "--actor", "ops:cy", "--note", "holiday")
	require.NoError(t, err)
	require.Equal(t, "schedule entry greet-ada: paused\n", out)
	out, _, err = e.greeter(t, "", "schedule", "pause", "greet-ada", "--actor", "ops:cy")
	require.NoError(t, err)
	require.Equal(t, "schedule entry greet-ada: paused already\n", out)

	out, _, err = e.greeter(t, "", "schedule", "ls", "--json")
	require.NoError(t, err)
	var rows []struct {
		Name     string          `json:"name"`
		Source   string          `json:"source"`
		Spec     string          `json:"spec"`
		TimeZone string          `json:"timezone"`
		Payload  json.RawMessage `json:"payload"`
		MaxRetry *int            `json:"max_retry"`
		Timeout  string          `json:"timeout"`
		Paused   *struct {
			By   string `json:"by"`
			Note string `json:"note"`
		} `json:"paused"`
		NextTick *string `json:"next_tick"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &rows))
	require.Len(t, rows, 1)
	r := rows[0]
	require.Equal(t, "30 2 * * *", r.Spec, "set changed the spec")
	require.Equal(t, "Europe/Berlin", r.TimeZone, "and kept what it was not given")
	require.JSONEq(t, `{"name":"ada"}`, string(r.Payload))
	require.Equal(t, 2, *r.MaxRetry)
	require.Equal(t, "1m30s", r.Timeout)
	require.Equal(t, "ledger", r.Source)
	require.Equal(t, "ops:cy", r.Paused.By)
	require.Equal(t, "holiday", r.Paused.Note)
	require.Nil(t, r.NextTick)

	out, _, err = e.greeter(t, "", "schedule", "resume", "greet-ada", "--actor", "ops:cy", "--json")
	require.NoError(t, err)
	require.JSONEq(t, `{"entry": "greet-ada", "action": "resume", "changed": true}`, out)
	out, _, err = e.greeter(t, "", "schedule", "rm", "greet-ada", "--actor", "ops:dee", "--note", "done")
	require.NoError(t, err)
	require.Equal(t, "schedule entry greet-ada: removed\n", out)
	_, _, err = e.greeter(t, "", "schedule", "rm", "greet-ada")
	require.ErrorIs(t, err, inspect.ErrNotFound)
	out, _, err = e.greeter(t, "", "schedule", "ls", "--json")
	require.NoError(t, err)
	require.JSONEq(t, `[]`, out)

	rows2, err := e.pool.Query(ctx, `SELECT action || ' ' || actor FROM keel_audit WHERE action LIKE '%-schedule:%' ORDER BY id`)
	require.NoError(t, err)
	audit, err := pgx.CollectRows(rows2, pgx.RowTo[string])
	require.NoError(t, err)
	require.Equal(t, []string{"add-schedule:greet-ada ops:ann", "set-schedule:greet-ada ops:bo", "pause-schedule:greet-ada ops:cy",
		"resume-schedule:greet-ada ops:cy", "remove-schedule:greet-ada ops:dee"}, audit)
}

// schedulerProcess runs `welcome scheduler` (no file: the ledger's entries
// alone) until the test ends, stopped with SIGTERM.
func schedulerProcess(t *testing.T, env []string) *testenv.SyncBuffer {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	cmd := exec.CommandContext(ctx, welcomeBinary(t), "scheduler", "--log-level", "info")
	cmd.Env = append([]string{"PATH=" + os.Getenv("PATH"), testenv.NoRaceExitSleep, "HOME=" + os.Getenv("HOME")}, env...)
	cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
	var stderr testenv.SyncBuffer
	cmd.Stderr = &stderr
	require.NoError(t, cmd.Start())
	t.Cleanup(func() {
		cancel()
		_ = cmd.Wait()
	})
	testenv.Eventually(t, 30*time.Second, func() bool { return strings.Contains(stderr.String(), "keel scheduler started") },
		"the scheduler did not start: %s", &stderr)
	return &stderr
}

// Two scheduler processes run an entry added with the CLI, one job per
// tick; a pause made with the CLI stops both, and one started during the
// pause keeps it; a resume starts at the next tick, with nothing caught up.
func TestScheduleAcrossSchedulerProcesses(t *testing.T) {
	e := setup(t)
	ctx := context.Background()
	env := []string{"REDIS_URL=" + e.redisURL(), "DATABASE_URL=" + e.databaseURL()}
	cli := func(args ...string) {
		t.Helper()
		r := welcome(t, env, args...)
		require.Equal(t, 0, r.code, r.stderr)
	}
	// The tick of each job the entry made, oldest first.
	ticks := func() []time.Time {
		rows, err := e.pool.Query(ctx, `SELECT business_key FROM keel_jobs WHERE kind = 'user:send_welcome' ORDER BY business_key`)
		require.NoError(t, err)
		keys, err := pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(t, err)
		var out []time.Time
		for _, k := range keys {
			at, err := time.Parse(time.RFC3339, strings.TrimPrefix(k, "cron:hello:"))
			require.NoError(t, err, k)
			out = append(out, at)
		}
		return out
	}
	a, b := schedulerProcess(t, env), schedulerProcess(t, env)

	cli("schedule", "add", "hello", "--spec", "@every 1s", "--kind", "user:send_welcome", "--payload", `{"user_id":"7"}`, "--note", "test")
	testenv.Eventually(t, 30*time.Second, func() bool { return len(ticks()) >= 3 }, "no ticks")
	got := ticks()
	for i := 1; i < len(got); i++ {
		require.Equal(t, time.Second, got[i].Sub(got[i-1]), "every second, one job each: %v", got)
	}

	testenv.Eventually(t, 30*time.Second, func() bool {
		r := welcome(t, env, "schedule", "ls", "--json")
		require.Equal(t, 0, r.code, r.stderr)
		return strings.Contains(r.stdout, `"running": true`)
	}, "the schedulers never said they run the entry")

	cli("schedule", "pause", "hello", "--note", "freeze")
	// Both have the pause once each has skipped a tick for it; any job
	// made after that would be a tick enqueued while paused.
	skipped := func(logs ...*testenv.SyncBuffer) bool {
		for _, l := range logs {
			if !strings.Contains(l.String(), "tick skipped: the entry is paused") {
				return false
			}
		}
		return true
	}
	testenv.Eventually(t, 30*time.Second, func() bool { return skipped(a, b) }, "the pause did not reach both schedulers:\n%s\n%s", a, b)
	frozen := ticks()
	c := schedulerProcess(t, env) // started while paused
	testenv.Eventually(t, 30*time.Second, func() bool { return skipped(c) }, "the new scheduler did not find the pause")
	require.Equal(t, frozen, ticks(), "no job while paused")

	resumed := time.Now()
	cli("schedule", "resume", "hello")
	testenv.Eventually(t, 30*time.Second, func() bool { return len(ticks()) > len(frozen) }, "no tick after the resume")
	after := ticks()[len(frozen)]
	require.True(t, after.After(resumed.Add(-time.Second)), "the first tick after the resume is %v, resumed at %v: a paused tick was caught up", after, resumed)
}
