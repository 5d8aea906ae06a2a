package cli_test

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/require"
)

// `retention set`, `ls` and `unset` as an operator runs them at 3 a.m.:
// each change audited with who and why, ls saying which policy is in
// force, and what a policy cannot say refused before anything is written.
func TestRetentionCommands(t *testing.T) {
	e := setup(t)
	ctx := context.Background()
	out, _, err := e.greeter(t, "", "retention", "set", "cli:greet", "--status", "succeeded", "--keep", "7d",
		"--actor", "ops:ann", "--note", "ledger at 80%")
	require.NoError(t, err)
	require.Equal(t, "retention of cli:greet succeeded jobs: kept 7d\n", out)
	out, _, err = e.greeter(t, "", "retention", "set", "cli:greet", "--status", "dead", "--keep", "90d", "--max-count", "1000",
		"--actor", "ops:ann", "--json")
	require.NoError(t, err)
	var set struct {
		Kind        string `json:"kind"`
		Status      string `json:"status"`
		KeepSeconds int64  `json:"keep_seconds"`
		MaxCount    int64  `json:"max_count"`
		InForce     bool   `json:"in_force"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &set))
	require.Equal(t, "dead", set.Status)
	require.Equal(t, int64(90*24*3600), set.KeepSeconds)
	require.Equal(t, int64(1000), set.MaxCount)
	require.True(t, set.InForce)

	out, _, err = e.greeter(t, "", "retention", "ls")
	require.NoError(t, err)
	require.Regexp(t, `KIND\s+STATUS\s+POLICY\s+SET BY\n`, out)
	require.Regexp(t, `cli:greet\s+dead\s+kept 90d, at most 1000 \(the oldest seen go\)\s+ops:ann `, out)
	require.Regexp(t, `cli:greet\s+succeeded\s+kept 7d\s+ops:ann \S+: ledger at 80%\n`, out)
	require.Contains(t, out, "dead letters for ever")
	out, _, err = e.greeter(t, "", "retention", "ls", "--json")
	require.NoError(t, err)
	var rows []struct {
		Kind, Status, Source, SetBy string
	}
	require.NoError(t, json.Unmarshal([]byte(out), &rows))
	require.Len(t, rows, 2)

	out, _, err = e.greeter(t, "", "retention", "unset", "cli:greet", "--status", "succeeded", "--actor", "ops:bo", "--note", "back",
		"--json")
	require.NoError(t, err)
	require.JSONEq(t, `{"kind": "cli:greet", "status": "succeeded", "action": "unset", "changed": true}`, out)
	out, _, err = e.greeter(t, "", "retention", "unset", "cli:greet", "--status", "succeeded")
	require.NoError(t, err)
	require.Equal(t, "retention of cli:greet succeeded jobs: no policy a person set\n", out)

	var audited []string
	rows2, err := e.pool.Query(ctx, `SELECT action || ' by ' || actor || ': ' || note FROM keel_audit WHERE action LIKE 'retention-%' ORDER BY at, id`)
	require.NoError(t, err)
	for rows2.Next() {
		var s string
		require.NoError(t, rows2.Scan(&s))
		audited = append(audited, s)
	}
	require.NoError(t, rows2.Err())
	require.Equal(t, []string{
		"retention-set:cli:greet/succeeded keep_ms=604800000 max_count=none by ops:ann: ledger at 80%",
		"retention-set:cli:greet/dead keep_ms=7776000000 max_count=1000 by ops:ann: ",
		"retention-unset:cli:greet/succeeded by ops:bo: back",
	}, audited)

	for _, bad := range [][]string{
		{"retention", "set", "cli:greet", "--status", "pending", "--keep", "7d"},
		{"retention", "set", "cli:greet", "--status", "succeeded", "--keep", "10m"},
		{"retention", "set", "cli:greet", "--status", "succeeded", "--max-count", "10"},
		{"retention", "set", "cli:greet", "--status", "succeeded"},
		{"retention", "set", "cli:greet", "--status", "succeeded", "--keep", "soon"},
		{"retention", "set", "cli:greet", "--status", "succeeded", "--keep", "7d", "--actor", " "},
		{"retention", "unset", "cli:greet", "--status", "running"},
	} {
		_, _, err := e.greeter(t, "", bad...)
		require.Error(t, err, "%q", bad)
	}
}

// A dead letter printed for a person (status, dead show) is recorded as
// seen, by whom; printed as JSON, for a program, it is not; a job that is
// not dead is never marked.
func TestShowingADeadLetterMarksItSeen(t *testing.T) {
	e := setup(t)
	ctx := context.Background()
	j := e.enqueueGreet(t, "ada")
	_, err := e.pool.Exec(ctx, `UPDATE keel_jobs SET status = 'dead', error_class = 'permanent', finished_at = now() WHERE id = $1`, j.ID)
	require.NoError(t, err)
	seenBy := func() string {
		var by *string
		require.NoError(t, e.pool.QueryRow(ctx, `SELECT CASE WHEN seen_at >= finished_at THEN seen_by END FROM keel_jobs WHERE id = $1`,
			j.ID).Scan(&by))
		if by == nil {
			return ""
		}
		return *by
	}
	_, _, err = e.greeter(t, "", "dead", "show", j.ID, "--json")
	require.NoError(t, err)
	_, _, err = e.greeter(t, "", "status", "--id", j.ID, "--json")
	require.NoError(t, err)
	require.Equal(t, 0, countRows(t, e, `SELECT count(*) FROM keel_jobs WHERE id = $1 AND seen_at IS NOT NULL`, j.ID))
	_, _, err = e.greeter(t, "", "dead", "show", j.ID)
	require.NoError(t, err)
	require.Regexp(t, `^cli:`, seenBy())

	// Seen before its latest death (replayed, dead again): unseen until
	// shown again, here by status.
	_, err = e.pool.Exec(ctx, `UPDATE keel_jobs SET seen_at = finished_at - interval '1 hour', seen_by = 'earlier' WHERE id = $1`, j.ID)
	require.NoError(t, err)
	require.Equal(t, "", seenBy())
	_, _, err = e.greeter(t, "", "status", "--id", j.ID)
	require.NoError(t, err)
	require.Regexp(t, `^cli:`, seenBy())

	ok := e.enqueueGreet(t, "bo")
	_, _, err = e.greeter(t, "", "status", "--id", ok.ID)
	require.NoError(t, err)
	require.Equal(t, 0, countRows(t, e, `SELECT count(*) FROM keel_jobs WHERE id = $1 AND seen_at IS NOT NULL`, ok.ID))
}

func countRows(t *testing.T, e *env, sql string, args ...any) int {
	t.Helper()
	var n int
	require.NoError(t, e.pool.QueryRow(context.Background(), sql, args...).Scan(&n))
	return n
}
