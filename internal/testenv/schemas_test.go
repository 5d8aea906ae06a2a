package testenv_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/internal/testenv"
)

// TestAReusedSchemaIsAsFresh checks that a schema handed from one test to
// the next comes back as a fresh migration leaves it: no rows of the test
// before, none of the structure it added or removed, and never one that a
// session of the test before still uses.
func TestAReusedSchemaIsAsFresh(t *testing.T) {
	ctx := context.Background()
	count := func(t *testing.T, db interface {
		QueryRow(context.Context, string, ...any) pgx.Row
	}, sql string) int {
		t.Helper()
		var n int
		require.NoError(t, db.QueryRow(ctx, sql).Scan(&n))
		return n
	}
	triggers := `SELECT count(*) FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
		WHERE c.relnamespace = current_schema()::regnamespace AND NOT t.tgisinternal`
	var first string
	var want int
	parent := t
	t.Run("a test leaves rows", func(t *testing.T) {
		pool, schema := testenv.PrivatePool(t)
		first = schema
		want = count(t, pool, triggers)
		require.Positive(t, want)
		_, err := pool.Exec(ctx, `INSERT INTO keel_jobs (id, kind, business_key, queue, payload, max_retry)
			VALUES ('j1', 'k', 'b', 'default', '{}', 3); INSERT INTO keel_audit (job_id, action, actor) VALUES ('j1', 'replay', 'me')`)
		require.NoError(t, err)
	})
	t.Run("the next finds none", func(t *testing.T) {
		pool, schema := testenv.PrivatePool(t)
		require.Equal(t, first, schema, "the schema is handed on")
		require.Zero(t, count(t, pool, `SELECT count(*) FROM keel_jobs`))
		require.Zero(t, count(t, pool, `SELECT count(*) FROM keel_audit`))
		// Not even dead rows: a test of what a query reads would count them.
		require.Zero(t, count(t, pool, `SELECT pg_relation_size('keel_jobs')`))
		require.Equal(t, 14, count(t, pool, `SELECT count(*) FROM keel_schema_migrations WHERE version <= 14`))
		_, err := pool.Exec(ctx, `INSERT INTO keel_jobs (id, kind, business_key, queue, payload, max_retry) VALUES ('j1', 'k', 'b', 'default', '{}', 3)`)
		require.NoError(t, err, "job j1 is gone")
		var id int
		require.NoError(t, pool.QueryRow(ctx, `INSERT INTO keel_audit (job_id, action, actor) VALUES ('j1', 'replay', 'me') RETURNING id`).Scan(&id))
		require.Equal(t, 1, id, "identities start again")
		// This test changes the structure.
		_, err = pool.Exec(ctx, `CREATE TABLE effects (n int); CREATE SEQUENCE first_commit; CREATE TYPE mood AS ENUM ('ok'); DROP TRIGGER `+firstTrigger(t, pool))
		require.NoError(t, err)
	})
	t.Run("a changed structure is migrated again", func(t *testing.T) {
		pool, schema := testenv.PrivatePool(t)
		require.Equal(t, first, schema)
		require.Zero(t, count(t, pool, `SELECT count(*) FROM pg_tables WHERE schemaname = current_schema() AND tablename = 'effects'`))
		require.Equal(t, want, count(t, pool, triggers))
		require.Zero(t, count(t, pool, `SELECT count(*) FROM keel_jobs`))
		// A session of this test outlives it.
		conn, err := pgx.Connect(ctx, testenv.URL(schema))
		require.NoError(t, err)
		parent.Cleanup(func() { conn.Close(ctx) })
	})
	t.Run("a schema still in use is not handed on", func(t *testing.T) {
		_, schema := testenv.PrivatePool(t)
		require.NotEqual(t, first, schema)
	})
}

func firstTrigger(t *testing.T, pool interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}) string {
	t.Helper()
	var name, table string
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT t.tgname, c.relname FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
		WHERE c.relnamespace = current_schema()::regnamespace AND NOT t.tgisinternal ORDER BY 1 LIMIT 1`).Scan(&name, &table))
	return pgx.Identifier{name}.Sanitize() + " ON " + pgx.Identifier{table}.Sanitize()
}
