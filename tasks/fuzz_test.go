package tasks_test

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"strings"
	"testing"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/internal/testenv"
	"github.com/keeljobs/keel/tasks"
)

// FuzzEnqueueKey feeds arbitrary business keys and payload text to Enqueue:
// it either refuses them with ErrInvalidKey or ErrPayloadTooLarge, or stores
// exactly that key and payload. `go test` runs the seeds; explore further with
// `go test -run '^$' -fuzz FuzzEnqueueKey ./tasks`.
func FuzzEnqueueKey(f *testing.F) {
	for _, seed := range []struct{ key, body string }{
		{"order:1", "hello"},
		{"", "empty key"},
		{"\x00", "NUL only"},
		{"order:\x00:1", "NUL inside"},
		{"\xff\xfe\xfd", "invalid UTF-8 key"},
		{"order:2", "invalid UTF-8 body \xff\xc3\x28"},
		{"\xed\xa0\x80", "a UTF-16 surrogate encoded as UTF-8"},
		{`"quoted"`, `"quoted" body`},
		{`back\slash\\`, `\u0000 \n \"`},
		{"o'rder'; DROP TABLE keel_jobs; --", "' OR 1=1 --"},
		{"$1 %s %v %!", "{{.}} ${x}"},
		{"заказ:🧾🚀", "emoji 🎉 and Ω"},
		{"<script>&amp;</script>", "<>&"},
		{" ", "\t\r\n"},
		{strings.Repeat("k", 1024), "longest key"},
		{strings.Repeat("k", 1025), "key one byte too long"},
		{strings.Repeat("é", 512), "1024 bytes in two-byte runes"},
		{strings.Repeat("é", 512) + "x", "1025 bytes"},
		{"big", strings.Repeat("a", tasks.MaxPayloadBytes)},
	} {
		f.Add(seed.key, seed.body)
	}
	b := fuzzBundle(f)
	ctx := context.Background()
	f.Fuzz(func(t *testing.T, key, body string) {
		task := keyedKind.New(keyed{Key: key, Body: body})
		res, err := b.client.Enqueue(ctx, task)
		if err != nil {
			if !errors.Is(err, tasks.ErrInvalidKey) && !errors.Is(err, tasks.ErrPayloadTooLarge) {
				t.Fatalf("key %q: unexpected error: %v", key, err)
			}
			return
		}
		// Each input is a new business action: forget it after checking.
		defer func() {
			_, err := b.pool.Exec(ctx, `DELETE FROM keel_jobs WHERE id = $1`, res.Job.ID)
			require.NoError(t, err)
		}()
		require.False(t, res.Existed, "key %q", key)
		got, err := b.store.Lookup(ctx, "test:keyed", key)
		require.NoError(t, err, "key %q was accepted but cannot be looked up", key)
		require.Equal(t, res.Job.ID, got.ID)
		require.Equal(t, key, got.BusinessKey)
		require.Equal(t, task.Payload(), got.Payload)
		require.NotNil(t, got.PublishedAt)
	})
}

// fuzzBundle is setup for the seed run inside `go test`. While fuzzing, every
// fuzz worker process calls it at once, so each gets a schema of its own; the
// coordinating process removes the schemas of earlier fuzzing runs first.
func fuzzBundle(f *testing.F) *bundle {
	if fl := flag.Lookup("test.fuzz"); fl == nil || fl.Value.String() == "" {
		pool, _ := testenv.PrivatePool(f)
		return newBundle(f, asynq.RedisClientOpt{Addr: testenv.StartRedis(f).Addr()}, pool)
	}
	prefix := schema + "_fuzz_"
	s := fmt.Sprintf("%s%d", prefix, os.Getpid())
	pool := testenv.Pool(f, s)
	if fl := flag.Lookup("test.fuzzworker"); fl == nil || fl.Value.String() != "true" {
		ctx := context.Background()
		rows, err := pool.Query(ctx, `SELECT nspname FROM pg_namespace WHERE starts_with(nspname, $1) AND nspname <> $2`, prefix, s)
		require.NoError(f, err)
		stale, err := pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(f, err)
		for _, name := range stale {
			_, err := pool.Exec(ctx, `DROP SCHEMA IF EXISTS `+pgx.Identifier{name}.Sanitize()+` CASCADE`)
			require.NoError(f, err)
		}
	}
	f.Cleanup(func() {
		_, _ = pool.Exec(context.Background(), `DROP SCHEMA IF EXISTS `+pgx.Identifier{s}.Sanitize()+` CASCADE`)
	})
	return newBundle(f, asynq.RedisClientOpt{Addr: testenv.RedisAddr(), DB: testenv.DBTasks}, pool)
}
