package cli_test

import (
	"context"
	"encoding/json"
	"strings"
	"testing"

	"github.com/hibiken/asynq"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/inspect"
	"github.com/keeljobs/keel/internal/jobstore"
)

// `cancel` in a program's own binary, as an operator runs it.
func TestCancelCommand(t *testing.T) {
	e := setup(t)
	redis, pool := e.redis, e.pool
	env := []string{"REDIS_URL=" + e.redisURL(), "DATABASE_URL=" + e.databaseURL()}
	store := jobstore.NewStore(pool)
	ctx := context.Background()
	insp := asynq.NewInspector(redis)
	defer insp.Close()

	enqueue := func(user string) string {
		t.Helper()
		r := welcome(t, env, "enqueue", "user:send_welcome", "--payload", `{"user_id":"`+user+`"}`, "--delay", "1h", "-o", "json")
		require.Equal(t, 0, r.code, r.stderr)
		var res struct {
			ID string `json:"id"`
		}
		require.NoError(t, json.Unmarshal([]byte(r.stdout), &res))
		return res.ID
	}

	id := enqueue("1")
	r := welcome(t, env, "cancel", id, "--note", "signed up twice", "--actor", "ops:alice")
	require.Equal(t, 0, r.code, r.stderr)
	require.Equal(t, id+": cancelled\n", r.stdout)
	j, err := store.Get(ctx, id)
	require.NoError(t, err)
	require.Equal(t, idempotency.StatusCancelled, j.Status)
	_, err = insp.GetTaskInfo(j.Queue, id)
	require.ErrorIs(t, err, asynq.ErrTaskNotFound, "the scheduled task left Redis")
	entries, err := auditOf(t, store, id)
	require.NoError(t, err)
	require.Len(t, entries, 1)
	require.Equal(t, "ops:alice", entries[0].Actor)
	require.Equal(t, "signed up twice", entries[0].Note)

	r = welcome(t, env, "cancel", id)
	require.Equal(t, 0, r.code, r.stderr)
	require.Equal(t, id+": already cancelled\n", r.stdout)
	r = welcome(t, env, "status", "--id", id)
	require.Equal(t, 0, r.code, r.stderr)
	require.Regexp(t, `status\s+cancelled\n`, r.stdout)
	require.Regexp(t, `resolved by\s+ops:alice\n`, r.stdout)

	// By kind and business key, with JSON.
	byKey := enqueue("2")
	r = welcome(t, env, "cancel", "--kind", "user:send_welcome", "--key", "user:2", "--json")
	require.Equal(t, 0, r.code, r.stderr)
	var out struct {
		Done, Failed int
		Jobs         []struct {
			ID     string `json:"id"`
			Status string `json:"status"`
		}
	}
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &out))
	require.Equal(t, 1, out.Done)
	require.Equal(t, byKey, out.Jobs[0].ID)
	require.Equal(t, "cancelled", out.Jobs[0].Status)
	// An id given twice is acted on once; one already cancelled is
	// unchanged, not done, as dead replay and discard count them.
	twice := enqueue("4")
	r = welcome(t, env, "cancel", twice, twice, byKey, "--json")
	require.Equal(t, 0, r.code, r.stderr)
	var counted struct{ Done, Unchanged, Failed int }
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &counted))
	require.Equal(t, struct{ Done, Unchanged, Failed int }{1, 1, 0}, counted)
	entries, err = auditOf(t, store, twice)
	require.NoError(t, err)
	require.Len(t, entries, 1, "one cancel recorded")

	// A finished job is refused, naming its status; one line, exit 1.
	done := enqueue("3")
	_, err = pool.Exec(ctx, `UPDATE keel_jobs SET status = 'succeeded', finished_at = now() WHERE id = $1`, done)
	require.NoError(t, err)
	r = welcome(t, env, "cancel", done)
	require.Equal(t, 1, r.code)
	require.Equal(t, "welcome: job cannot be cancelled: job "+done+" is succeeded\n", r.stderr)

	for _, c := range []struct {
		args []string
		code int
		want string
	}{
		{[]string{"cancel", "not-a-uuid"}, 2, `job id "not-a-uuid" is malformed`},
		{[]string{"cancel", "01936f3e-8c1a-7b2e-9f00-1a2b3c4d5e6f"}, 1, `no job with id "01936f3e-8c1a-7b2e-9f00-1a2b3c4d5e6f"`},
		{[]string{"cancel", "--kind", "user:send_welcome", "--key", "user:404"}, 1, `no job with kind "user:send_welcome" and business key "user:404"`},
		{[]string{"cancel"}, 2, "name job ids, or one job by --kind and --key"},
		{[]string{"cancel", "--kind", "user:send_welcome"}, 2, "--kind and --key go together"},
		{[]string{"cancel", id, "--kind", "user:send_welcome", "--key", "user:1"}, 2, "not both"},
		{[]string{"cancel", id, "--actor", " "}, 2, "actor"},
	} {
		r := welcome(t, env, c.args...)
		require.Equal(t, c.code, r.code, "%v: %s", c.args, r.stderr)
		require.Equal(t, 1, strings.Count(r.stderr, "\n"), "%v: one line, got:\n%s", c.args, r.stderr)
		require.Contains(t, r.stderr, c.want, "%v", c.args)
	}
}

// auditOf is job id's audit log, as the operator API reads it.
func auditOf(t *testing.T, store *jobstore.Store, id string) ([]inspect.AuditEntry, error) {
	t.Helper()
	ops, err := inspect.New(inspect.Config{Pool: store.Pool()})
	require.NoError(t, err)
	return ops.Audit(t.Context(), id)
}
