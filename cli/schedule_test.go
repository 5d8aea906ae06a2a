package cli_test

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/inspect"
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
	require.Regexp(t, `greet-ada\s+ledger\s+0 2 \* \* \* \(Europe/Berlin\)\s+cli:greet\s+-\s+-\s+\S+T\S+\s+no\n`, out)

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
