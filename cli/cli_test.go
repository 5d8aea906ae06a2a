package cli_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/spf13/cobra"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"golang.org/x/crypto/bcrypt"

	"github.com/keeljobs/keel/cli"
	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/inspect"
	"github.com/keeljobs/keel/internal/jobstore"
	"github.com/keeljobs/keel/internal/ledger"
	"github.com/keeljobs/keel/internal/testenv"
	"github.com/keeljobs/keel/migrate"
	"github.com/keeljobs/keel/tasks"
)

func TestMain(m *testing.M) {
	code := m.Run()
	if buildDir != "" {
		os.RemoveAll(buildDir)
	}
	if code == 0 {
		if err := goleak.Find(); err != nil {
			os.Stderr.WriteString("goleak: " + err.Error() + "\n")
			code = 1
		}
	}
	os.Exit(code)
}

type Greeting struct {
	Name string `json:"name"`
}

var Greet = tasks.Define[Greeting]("cli:greet",
	tasks.Key(func(g Greeting) string { return "greet:" + g.Name }))

func testApp() cli.App {
	return cli.App{Name: "greeter", Kinds: tasks.NewKinds(Greet)}
}

// env is what a test's commands run against: a ledger schema and a Redis
// of its own.
type env struct {
	pool   *pgxpool.Pool
	schema string
	redis  asynq.RedisClientOpt
}

// setup gives the test its env and runs it in parallel with the package's
// others.
func setup(t *testing.T) *env {
	t.Helper()
	t.Parallel()
	return setupAlone(t)
}

// setupAlone is setup for a test that sets process environment variables,
// which the commands read: it runs before the parallel ones.
func setupAlone(t *testing.T) *env {
	t.Helper()
	e := &env{redis: asynq.RedisClientOpt{Addr: testenv.StartRedis(t).Addr()}}
	e.pool, e.schema = testenv.PrivatePool(t)
	return e
}

// offline is the env of a test whose commands reach neither Redis nor
// Postgres: nothing answers at its addresses.
var offline = &env{schema: "keel_test_cli_offline", redis: asynq.RedisClientOpt{Addr: "127.0.0.1:1"}}

func (e *env) redisURL() string { return "redis://" + e.redis.Addr + "/0" }

func (e *env) databaseURL() string { return testenv.URL(e.schema) }

// greeter runs the program's real root command in-process against e;
// stdout and stderr apart.
func (e *env) greeter(t *testing.T, stdin string, args ...string) (stdout, stderr string, err error) {
	t.Helper()
	return e.runApp(t, testApp(), stdin, args...)
}

// keelApp is greeter for a program that declares no kinds, as keel itself:
// it takes a business key as given.
func (e *env) keelApp(t *testing.T, stdin string, args ...string) (stdout, stderr string, err error) {
	t.Helper()
	return e.runApp(t, cli.App{Name: "keel"}, stdin, args...)
}

func (e *env) runApp(t *testing.T, app cli.App, stdin string, args ...string) (stdout, stderr string, err error) {
	t.Helper()
	root := cli.New(app)
	var out, errb bytes.Buffer
	root.SetOut(&out)
	root.SetErr(&errb)
	root.SetIn(strings.NewReader(stdin))
	root.SetArgs(append([]string{"--redis-url", e.redisURL(), "--database-url", e.databaseURL(), "--log-level", "error"}, args...))
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	err = root.ExecuteContext(ctx)
	return out.String(), errb.String(), err
}

// enqueueGreet enqueues the greeting of name and returns its job.
func (e *env) enqueueGreet(t *testing.T, name string) jobOut {
	t.Helper()
	out, _, err := e.greeter(t, "", "enqueue", "cli:greet", "--payload", `{"name": "`+name+`"}`, "--json")
	require.NoError(t, err)
	var j jobOut
	require.NoError(t, json.Unmarshal([]byte(out), &j))
	return j
}

type jobOut struct {
	Line        int    `json:"line"`
	ID          string `json:"id"`
	Kind        string `json:"kind"`
	BusinessKey string `json:"business_key"`
	Queue       string `json:"queue"`
	Existed     bool   `json:"existed"`
}

func TestEnqueueInputs(t *testing.T) {
	e := setupAlone(t) // sets the environment
	pool := e.pool
	ctx := context.Background()
	store := jobstore.NewStore(pool)

	// --payload-file, and - for stdin.
	file := filepath.Join(t.TempDir(), "p.json")
	require.NoError(t, os.WriteFile(file, []byte(`{"name": "ann"}`+"\n"), 0o600))
	out, _, err := e.greeter(t, "", "enqueue", "cli:greet", "--payload-file", file)
	require.NoError(t, err)
	require.Contains(t, out, "created")
	require.Contains(t, out, "business key greet:ann")
	out, _, err = e.greeter(t, `{"name": "bob"}`, "enqueue", "cli:greet", "--payload-file", "-", "--json")
	require.NoError(t, err)
	var one jobOut
	require.NoError(t, json.Unmarshal([]byte(out), &one))
	require.Equal(t, "greet:bob", one.BusinessKey)
	j, err := store.Get(ctx, one.ID)
	require.NoError(t, err)
	require.JSONEq(t, `{"name":"bob"}`, string(j.Payload))
	_, _, err = e.greeter(t, "", "enqueue", "cli:greet", "--payload-file", file, "--payload", "{}")
	require.ErrorContains(t, err, "not both")
	// The same key with another payload (a program without declared kinds
	// takes the key as given): the job keeps its first, and says so.
	out, _, err = e.keelApp(t, "", "enqueue", "cli:greet", "greet:ann", "--payload", `{"name": "zed"}`)
	require.NoError(t, err)
	require.Contains(t, out, "already existed with another payload, which it keeps")
	// A payload over the client's limit is refused by it, from a file too.
	big := filepath.Join(t.TempDir(), "big.json")
	require.NoError(t, os.WriteFile(big, []byte(`{"name": "`+strings.Repeat("x", tasks.MaxPayloadBytes)+`"}`), 0o600))
	_, _, err = e.greeter(t, "", "enqueue", "cli:greet", "--payload-file", big)
	require.ErrorIs(t, err, tasks.ErrPayloadTooLarge)

	// --from: JSON lines, checked before anything is enqueued.
	lines := `{"kind": "cli:greet", "payload": {"name": "cy"}}
# a comment, and an empty line

{"kind": "cli:greet", "key": "greet:dee", "payload": {"name": "dee"}, "queue": "low", "delay": "1h", "max_retry": 2}
{"kind": "cli:greet", "payload": {"name": "ann"}}
`
	from := filepath.Join(t.TempDir(), "jobs.jsonl")
	require.NoError(t, os.WriteFile(from, []byte(lines), 0o600))
	out, _, err = e.greeter(t, "", "enqueue", "--from", from, "--dry-run")
	require.NoError(t, err)
	require.Contains(t, out, "dry run: 3 job(s) checked; nothing was enqueued")
	// A dry run does not look the jobs up, so it says nothing of whether
	// they exist.
	out, _, err = e.greeter(t, "", "enqueue", "--from", from, "--dry-run", "--json")
	require.NoError(t, err)
	require.Contains(t, out, `"business_key": "greet:cy"`)
	require.NotContains(t, out, "existed")
	_, err = store.Lookup(ctx, "cli:greet", "greet:cy")
	require.ErrorIs(t, err, idempotency.ErrNotFound, "a dry run enqueues nothing")

	out, stderr, err := e.greeter(t, "", "enqueue", "--from", from, "-o", "json")
	require.NoError(t, err)
	require.Empty(t, stderr, "no progress bar where stderr is not a terminal")
	var many struct {
		Created, Existed int
		Jobs             []jobOut
	}
	require.NoError(t, json.Unmarshal([]byte(out), &many))
	require.Equal(t, 2, many.Created)
	require.Equal(t, 1, many.Existed)
	require.Equal(t, []int{1, 4, 5}, []int{many.Jobs[0].Line, many.Jobs[1].Line, many.Jobs[2].Line})
	require.True(t, many.Jobs[2].Existed, "ann was enqueued from the file before")
	dee, err := store.Lookup(ctx, "cli:greet", "greet:dee")
	require.NoError(t, err)
	require.Equal(t, "low", dee.Queue)
	require.Equal(t, 2, dee.MaxRetry)
	require.Greater(t, time.Until(dee.RunAt), 50*time.Minute)

	out, _, err = e.greeter(t, `{"kind": "cli:greet", "payload": {"name": "eve"}}`+"\n", "enqueue", "--from", "-")
	require.NoError(t, err)
	require.Contains(t, out, "1 job(s) from -: 1 created, 0 already existed")
	// A file saved with a byte-order mark.
	out, _, err = e.greeter(t, "\ufeff"+`{"kind": "cli:greet", "payload": {"name": "bom"}}`+"\n", "enqueue", "--from", "-")
	require.NoError(t, err)
	require.Contains(t, out, "1 job(s) from -: 1 created, 0 already existed")

	for _, tc := range []struct{ input, want string }{
		{`{"kind": "cli:greet", "payload": {"name": "fay"}}` + "\n" + `{"kind": "cli:nope", "payload": {}}`, `- line 2: greeter does not declare the kind "cli:nope"`},
		{`{"kind": "cli:greet", "payload": {"name": 3}}`, "- line 1: payload does not decode into cli:greet's type"},
		{`{"kind": "cli:greet", "payload": {"name": "x"}, "priority": 1}`, `- line 1: not a job`},
		{`{"kind": "cli:greet", "payload": {"name": "x"}, "delay": "soon"}`, `- line 1: delay "soon"`},
		{`{"payload": {}}`, "- line 1: no kind"},
		{"\n# nothing\n", "holds no jobs"},
		// One job a line: a second value on the line is not dropped unseen.
		{`{"kind": "cli:greet", "payload": {"name": "fay"}}{"kind": "cli:greet", "payload": {"name": "gus"}}`, "- line 1: more than one JSON value"},
		{`{"kind": "cli:greet", "payload": {"name": "fay"}} trailing`, "- line 1: more than one JSON value"},
		// A line over the limit is named too.
		{`{"kind": "cli:greet", "payload": {"name": "fay"}}` + "\n" + strings.Repeat("x", 4*tasks.MaxPayloadBytes+1), "- line 2: longer than"},
	} {
		_, _, err := e.greeter(t, tc.input, "enqueue", "--from", "-")
		require.ErrorContains(t, err, tc.want, tc.input)
		require.True(t, cli.IsUsageError(err))
	}
	_, err = store.Lookup(ctx, "cli:greet", "greet:fay")
	require.ErrorIs(t, err, idempotency.ErrNotFound, "a bad line stops the whole file")
	_, _, err = e.greeter(t, "", "enqueue", "cli:greet", "--from", from)
	require.ErrorContains(t, err, "--from takes each job's kind")
	// What only the client checks (the queue) names the line too; the batch
	// goes in whole or not at all.
	_, _, err = e.greeter(t, `{"kind": "cli:greet", "payload": {"name": "q1"}}`+"\n"+`{"kind": "cli:greet", "payload": {"name": "q2"}, "queue": "nope"}`,
		"enqueue", "--from", "-")
	require.ErrorIs(t, err, tasks.ErrUnknownQueue)
	require.ErrorContains(t, err, "- line 2: ")
	require.ErrorContains(t, err, "nothing was enqueued")
	require.True(t, cli.IsUsageError(err))
	_, err = store.Lookup(ctx, "cli:greet", "greet:q1")
	require.ErrorIs(t, err, idempotency.ErrNotFound)

	// Every line is checked before the first is written, against what the
	// client checks too, however many batches the file makes; a dry run
	// checks the same.
	var lines1001 strings.Builder
	for i := range 1001 {
		fmt.Fprintf(&lines1001, `{"kind": "cli:greet", "payload": {"name": "many%d"}}`+"\n", i)
	}
	for _, bad := range []string{`"max_retry": -1`, `"queue": "nope"`, `"key": "` + strings.Repeat("k", 1025) + `"`} {
		input := lines1001.String() + `{"kind": "cli:greet", "payload": {"name": "last"}, ` + bad + `}` + "\n"
		for _, dry := range []bool{true, false} {
			args := []string{"enqueue", "--from", "-"}
			if dry {
				args = append(args, "--dry-run")
			}
			_, _, err = e.greeter(t, input, args...)
			require.ErrorContains(t, err, "- line 1002: ", bad)
			require.ErrorContains(t, err, "nothing was enqueued", bad)
			require.True(t, cli.IsUsageError(err), bad)
		}
	}
	_, err = store.Lookup(ctx, "cli:greet", "greet:many0")
	require.ErrorIs(t, err, idempotency.ErrNotFound, "the first batch went in before the bad line was seen")

	// Queues named in KEEL_QUEUES, as the worker takes them, are known.
	t.Setenv("KEEL_QUEUES", "reports:1,default:1")
	out, _, err = e.greeter(t, `{"kind": "cli:greet", "payload": {"name": "rep"}, "queue": "reports"}`, "enqueue", "--from", "-")
	require.NoError(t, err)
	require.Contains(t, out, "1 created")

	// A single job's dry run says so and enqueues nothing.
	out, _, err = e.greeter(t, "", "enqueue", "cli:greet", "--payload", `{"name": "gus"}`, "--dry-run")
	require.NoError(t, err)
	require.Contains(t, out, "dry run: 1 job(s) checked; nothing was enqueued")
	require.Contains(t, out, "would enqueue cli:greet greet:gus on queue default")
	_, err = store.Lookup(ctx, "cli:greet", "greet:gus")
	require.ErrorIs(t, err, idempotency.ErrNotFound)
}

// A program that declares no kinds (the stock keel) enqueues any kind, with
// an explicit key.
func TestEnqueueUndeclaredKindsInAProgramWithout(t *testing.T) {
	e := setup(t)
	root := cli.New(cli.App{Name: "keel"})
	var out bytes.Buffer
	root.SetOut(&out)
	root.SetArgs([]string{"--redis-url", e.redisURL(), "--database-url", e.databaseURL(),
		"enqueue", "other:kind", "k1", "--payload", `{"any": ["thing"]}`})
	require.NoError(t, root.ExecuteContext(context.Background()))
	require.Contains(t, out.String(), "created")

	root = cli.New(cli.App{Name: "keel"})
	root.SetOut(&bytes.Buffer{})
	root.SetArgs([]string{"--redis-url", e.redisURL(), "--database-url", e.databaseURL(),
		"enqueue", "other:kind", "--payload", `{}`})
	require.ErrorContains(t, root.ExecuteContext(context.Background()), "give a business key")

	root = cli.New(cli.App{Name: "keel"})
	root.SetArgs([]string{"worker"})
	err := root.ExecuteContext(context.Background())
	require.ErrorContains(t, err, "keel has no handlers to run")
	require.True(t, cli.IsUsageError(err))
}

func TestStatusAndDeadLetters(t *testing.T) {
	e := setup(t)
	pool := e.pool
	ctx := context.Background()

	out, _, err := e.greeter(t, "", "enqueue", "cli:greet", "--payload", `{"name": "hal"}`, "--json")
	require.NoError(t, err)
	var hal jobOut
	require.NoError(t, json.Unmarshal([]byte(out), &hal))

	// A job waiting to retry shows when.
	next := time.Now().Add(90 * time.Second).Truncate(time.Second)
	_, err = pool.Exec(ctx, `UPDATE keel_jobs SET status = 'failed', attempts = 1, last_error = '503', error_class = 'transient',
		run_at = $2 WHERE id = $1`, hal.ID, next)
	require.NoError(t, err)
	out, _, err = e.greeter(t, "", "status", "cli:greet", "greet:hal")
	require.NoError(t, err)
	require.Regexp(t, `next retry\s+`+next.Format(time.RFC3339)+` \(in 1m\d+s\)`, out)
	out, _, err = e.greeter(t, "", "-o", "json", "status", "--id", hal.ID)
	require.NoError(t, err)
	var st struct {
		Status      string     `json:"status"`
		NextRetryAt *time.Time `json:"next_retry_at"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &st))
	require.Equal(t, "failed", st.Status)
	require.NotNil(t, st.NextRetryAt)
	require.True(t, next.Equal(*st.NextRetryAt))

	// Other spellings of the same UUID find the job.
	for _, spelling := range []string{strings.ToUpper(hal.ID), strings.ReplaceAll(hal.ID, "-", ""), "{" + hal.ID + "}", "urn:uuid:" + hal.ID} {
		out, _, err = e.greeter(t, "", "status", "--id", spelling)
		require.NoError(t, err, spelling)
		require.Contains(t, out, hal.ID)
		out, _, err = e.greeter(t, "", "dead", "show", spelling)
		require.NoError(t, err, spelling)
		require.Contains(t, out, hal.ID)
	}
	_, _, err = e.greeter(t, "", "status", "--id", "not-a-uuid")
	require.ErrorContains(t, err, `--id "not-a-uuid" is malformed`)
	require.True(t, cli.IsUsageError(err))
	_, _, err = e.greeter(t, "", "status", "--id", "01936f3e-8c1a-7b2e-9f00-1a2b3c4d5e6f")
	require.ErrorIs(t, err, idempotency.ErrNotFound)
	_, _, err = e.greeter(t, "", "dead", "show", "nope")
	require.ErrorContains(t, err, "malformed")
	_, _, err = e.greeter(t, "", "-o", "yaml", "version")
	require.ErrorContains(t, err, `--output "yaml": want text or json`)
	_, _, err = e.greeter(t, "", "-o", "text", "--json", "version")
	require.ErrorContains(t, err, "--output text and --json disagree")
	require.True(t, cli.IsUsageError(err))
	_, _, err = e.greeter(t, "", "-o", "json", "--json", "version")
	require.NoError(t, err, "they agree")

	// Windows that hold no time are refused, not answered with nothing.
	_, _, err = e.greeter(t, "", "dead", "ls", "--since", "-2h")
	require.ErrorContains(t, err, "is in the future")
	require.True(t, cli.IsUsageError(err))
	_, _, err = e.greeter(t, "", "dead", "ls", "--since", "2h", "--until", "3h")
	require.ErrorContains(t, err, "the window is empty")
	require.True(t, cli.IsUsageError(err))
	// Who acts is said before anything is asked or done.
	_, _, err = e.greeter(t, "", "dead", "discard", "--all", "--note", "x", "--actor", " ")
	require.ErrorIs(t, err, inspect.ErrActorRequired)
	require.True(t, cli.IsUsageError(err))
	// The ledger's figures name every status, those with no rows too.
	out, _, err = e.greeter(t, "", "ledger", "--json")
	require.NoError(t, err)
	var stats struct {
		Rows map[string]int64 `json:"rows_by_status"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &stats))
	require.Len(t, stats.Rows, 7, "rows by status: %v", stats.Rows)

	// Dead letters: a bogus class names the real ones.
	_, _, err = e.greeter(t, "", "dead", "ls", "--class", "bogus")
	require.ErrorContains(t, err, `--class "bogus": no such class; dead jobs carry permanent, transient, unknown, timeout, crashed, waited_too_long`)
	_, err = pool.Exec(ctx, `UPDATE keel_jobs SET status = 'dead', error_class = 'crashed', finished_at = now() WHERE id = $1`, hal.ID)
	require.NoError(t, err)
	out, _, err = e.greeter(t, "", "dead", "ls", "--class", "crashed", "--json")
	require.NoError(t, err)
	require.Contains(t, out, `"total": 1`)

	out, _, err = e.greeter(t, "", "dead", "replay", "--all", "--dry-run", "--json")
	require.NoError(t, err)
	var dry struct {
		DryRun bool     `json:"dry_run"`
		Count  int      `json:"count"`
		IDs    []string `json:"ids"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &dry))
	require.Equal(t, struct {
		DryRun bool     `json:"dry_run"`
		Count  int      `json:"count"`
		IDs    []string `json:"ids"`
	}{true, 1, []string{hal.ID}}, dry)
	out, _, err = e.greeter(t, "", "dead", "replay", "--all", "--dry-run")
	require.NoError(t, err)
	require.Equal(t, "dry run: would replay 1 job(s); nothing was changed\n", out)
	// By id, a dry run looks at each job; filters do not apply to ids.
	const nobody = "01936f3e-8c1a-7b2e-9f00-1a2b3c4d5e6f"
	out, _, err = e.greeter(t, "", "dead", "replay", hal.ID, nobody, "--dry-run")
	require.ErrorContains(t, err, "1 job(s) could not be replayed", "as the real run would fail")
	require.Contains(t, out, "replay "+nobody+": would fail: no job with this id")
	require.Contains(t, out, "dry run: would replay 1 job(s)")
	_, _, err = e.greeter(t, "", "dead", "replay", hal.ID, "--kind", "other:kind", "--dry-run")
	require.ErrorContains(t, err, "--kind selects jobs with --all")
	require.True(t, cli.IsUsageError(err))

	out, stderr, err := e.greeter(t, "", "dead", "replay", hal.ID, "--json")
	require.NoError(t, err)
	require.NotContains(t, stderr, "\r", "no progress bar where stderr is not a terminal")
	var act struct {
		Action string `json:"action"`
		Done   int    `json:"done"`
		Failed int    `json:"failed"`
		Jobs   []struct {
			ID    string `json:"id"`
			Error string `json:"error"`
		} `json:"jobs"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &act))
	require.Equal(t, "replay", act.Action)
	require.Equal(t, 1, act.Done)
	require.Equal(t, hal.ID, act.Jobs[0].ID)
	// Again, and the same id twice: nothing to do, and said so once.
	out, _, err = e.greeter(t, "", "dead", "replay", hal.ID, hal.ID)
	require.NoError(t, err)
	require.Contains(t, out, "replay "+hal.ID+": nothing to do: the job is pending, not dead")
	require.Contains(t, out, "replay: 0 done, 1 unchanged, 0 failed")

	// Discarding a job that is not dead fails, and says so per job in JSON.
	out, _, err = e.greeter(t, "", "dead", "discard", hal.ID, "--note", "gone", "--json")
	require.ErrorContains(t, err, "1 job(s) could not be discarded")
	require.NoError(t, json.Unmarshal([]byte(out), &act))
	require.Equal(t, 1, act.Failed)
	require.NotEmpty(t, act.Jobs[0].Error)

	// Discarding a discarded job keeps the first resolution, and says so.
	_, err = pool.Exec(ctx, `UPDATE keel_jobs SET status = 'dead', finished_at = now() WHERE id = $1`, hal.ID)
	require.NoError(t, err)
	out, _, err = e.greeter(t, "", "dead", "discard", hal.ID, "--note", "first", "--actor", "ann")
	require.NoError(t, err)
	require.Contains(t, out, "discard: 1 done, 0 unchanged, 0 failed")
	out, _, err = e.greeter(t, "", "dead", "discard", hal.ID, "--note", "again", "--json")
	require.NoError(t, err)
	var again struct {
		Done, Unchanged int
		Jobs            []struct{ Unchanged string }
	}
	require.NoError(t, json.Unmarshal([]byte(out), &again))
	require.Equal(t, 0, again.Done)
	require.Equal(t, 1, again.Unchanged)
	require.Contains(t, again.Jobs[0].Unchanged, `already discarded by ann: "first"`)

	// The schedule check names an entry whose kind the program lacks, and
	// prints JSON.
	_, _, err = e.greeter(t, "", "scheduler", "--check", "--config", "../examples/schedule.yaml")
	require.ErrorContains(t, err, "analytics:sync")
	out, _, err = e.greeter(t, "", "scheduler", "--check", "--config", "../examples/schedule.yaml", "--allow-unknown-kinds", "--json")
	require.NoError(t, err)
	var sched struct {
		Entries []struct {
			Name string      `json:"name"`
			Next []time.Time `json:"next_ticks"`
		} `json:"entries"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &sched))
	require.NotEmpty(t, sched.Entries)
	require.Len(t, sched.Entries[0].Next, 3)

	out, _, err = e.greeter(t, "", "migrate", "--json")
	require.NoError(t, err)
	require.JSONEq(t, `{"from": `+itoa(migrate.Version())+`, "to": `+itoa(migrate.Version())+`, "applied": []}`, out)

	out, _, err = e.greeter(t, "", "healthcheck", "--json")
	require.NoError(t, err)
	require.JSONEq(t, `{"ok": true, "ledger_schema": `+itoa(migrate.Version())+`}`, out)
}

// Every mistake in the command line is a usage error (exit status 2), the
// ones cobra finds too: an unknown command or flag, a flag value of the
// wrong type, arguments a command does not take.
func TestCommandLineMistakesAreUsageErrors(t *testing.T) {
	for _, args := range [][]string{
		{"--bogus"},
		{"nosuchcmd"},
		{"dead", "ls", "--limit", "abc"},
		{"dead", "ls", "--limit", "5000"},
		{"ledger", "extra"},
		{"dead", "nosuchsub"},
	} {
		root := cli.New(cli.App{Name: "keel"})
		root.SetOut(&bytes.Buffer{})
		root.SetErr(&bytes.Buffer{})
		root.SetArgs(args)
		err := root.ExecuteContext(context.Background())
		require.Error(t, err, "%v", args)
		require.True(t, cli.IsUsageError(err), "%v: %v", args, err)
	}
	// A typo gets cobra's suggestion.
	root := cli.New(cli.App{Name: "keel"})
	root.SetArgs([]string{"daed"})
	require.ErrorContains(t, root.ExecuteContext(context.Background()), "did you mean dead?")
	root = cli.New(cli.App{Name: "keel"})
	root.SetArgs([]string{"dead", "shw"})
	require.ErrorContains(t, root.ExecuteContext(context.Background()), "did you mean show?")

	// A bare group prints its help, whatever else is wrong.
	t.Setenv("KEEL_LOG_LEVEL", "verbose")
	for _, args := range [][]string{nil, {"dead"}} {
		root = cli.New(cli.App{Name: "keel"})
		var out bytes.Buffer
		root.SetOut(&out)
		root.SetArgs(args)
		require.NoError(t, root.ExecuteContext(context.Background()), "%v prints its help", args)
		require.Contains(t, out.String(), "Available Commands")
	}
}

// A dead job with a step in doubt is settled from the command line: the
// person says whether the call happened, then replays it.
func TestResolveAStepInDoubtFromTheCommandLine(t *testing.T) {
	e := setup(t)
	pool := e.pool
	ctx := context.Background()
	store := jobstore.NewStore(pool)
	var ids []string
	for _, name := range []string{"doubt1", "doubt2"} {
		j := e.enqueueGreet(t, name)
		_, err := pool.Exec(ctx, `UPDATE keel_jobs SET status = 'dead', error_class = 'permanent', finished_at = now(),
			last_error = 'in doubt: needs a person' WHERE id = $1`, j.ID)
		require.NoError(t, err)
		_, err = pool.Exec(ctx, `INSERT INTO keel_steps (job_id, name, status) VALUES ($1, 'charge', 'started')`, j.ID)
		require.NoError(t, err)
		ids = append(ids, j.ID)
	}

	_, stderr, err := e.greeter(t, "", "dead", "replay", ids[0])
	require.Error(t, err)
	require.Contains(t, stderr, "greeter dead resolve")
	out, _, err := e.greeter(t, "", "dead", "replay", ids[0], "--dry-run")
	require.Error(t, err, "a dry run fails where the replay would")
	require.Contains(t, out, "would fail: ")
	require.Contains(t, out, "charge")
	out, _, err = e.greeter(t, "", "dead", "show", ids[0])
	require.NoError(t, err)
	require.Contains(t, out, "in doubt")
	require.Contains(t, out, "greeter dead resolve "+ids[0]+" charge")
	require.Contains(t, out, "key "+ids[0]+":charge", "the key to look up at the other system")
	// dead ls --json lists each job's steps, as dead show does.
	out, _, err = e.greeter(t, "", "dead", "ls", "--json")
	require.NoError(t, err)
	var listed struct {
		Jobs []struct {
			ID    string
			Steps []struct{ Name, Status string }
		}
	}
	require.NoError(t, json.Unmarshal([]byte(out), &listed))
	var found bool
	for _, j := range listed.Jobs {
		if j.ID == ids[0] {
			found = true
			require.Equal(t, []struct{ Name, Status string }{{"charge", "started"}}, j.Steps)
		}
	}
	require.True(t, found, "dead ls --json lists %s", ids[0])
	// A dry run of --all looks at each job it selects, as by id.
	out, _, err = e.greeter(t, "", "dead", "replay", "--all", "--dry-run")
	require.Error(t, err, "a dry run fails where the replay would")
	require.Contains(t, out, "replay "+ids[0]+": would fail: ")
	require.NotContains(t, out, "would replay 2 job(s)")
	// And the question before a bulk replay says how many stay dead.
	_, stderr, err = e.greeter(t, "no\n", "dead", "replay", "--all")
	require.ErrorContains(t, err, "not confirmed")
	require.Contains(t, stderr, "2 of them cannot be replayed")
	require.Contains(t, stderr, "type 2 to replay them: ", "as the README quotes it")

	for _, args := range [][]string{
		{"dead", "resolve", ids[0], "charge"},
		{"dead", "resolve", ids[0], "charge", "--happened", "--not-happened"},
		{"dead", "resolve", ids[0]},
		{"dead", "resolve", "not-an-id", "charge", "--happened"},
	} {
		_, _, err := e.greeter(t, "", args...)
		require.True(t, cli.IsUsageError(err), "%v: %v", args, err)
	}
	_, _, err = e.greeter(t, "", "dead", "resolve", ids[0], "charge", "--happened", "--not-happened")
	require.ErrorContains(t, err, "say one, not both")
	_, _, err = e.greeter(t, "", "dead", "resolve", ids[0], "refund", "--happened")
	require.ErrorContains(t, err, `no step "refund" recorded`)

	out, _, err = e.greeter(t, "", "dead", "resolve", ids[0], "charge", "--not-happened", "--note", "no charge at the provider", "--actor", "ops")
	require.NoError(t, err)
	require.Contains(t, out, "did not happen")
	steps, err := store.Steps(ctx, ids[0])
	require.NoError(t, err)
	require.Empty(t, steps, "a call that did not happen is forgotten: the replay calls again")
	out, _, err = e.greeter(t, "", "dead", "resolve", ids[1], "charge", "--happened", "--json")
	require.NoError(t, err)
	require.Contains(t, out, `"happened": true`)
	steps, err = store.Steps(ctx, ids[1])
	require.NoError(t, err)
	require.Equal(t, "done", steps[0].Status, "a call that happened is done: the replay skips it")
	// Saying it again changes nothing and is not an error; saying the
	// opposite of what is recorded is refused with what is recorded.
	_, _, err = e.greeter(t, "", "dead", "resolve", ids[1], "charge", "--happened")
	require.NoError(t, err, "already so")
	_, _, err = e.greeter(t, "", "dead", "resolve", ids[1], "charge", "--not-happened")
	require.ErrorContains(t, err, `step "charge" of job `+ids[1]+` is done, not in doubt`)
	_, _, err = e.greeter(t, "", "dead", "resolve", ids[0], "charge", "--not-happened")
	require.NoError(t, err, "said twice that it did not happen: already so")
	_, _, err = e.greeter(t, "", "dead", "resolve", ids[0], "refund", "--not-happened")
	require.ErrorContains(t, err, `no step "refund" recorded for job `+ids[0]+` (never started)`)
	audit, err := auditOf(t, store, ids[0])
	require.NoError(t, err)
	require.Len(t, audit, 1, "saying it again records nothing more")
	require.Equal(t, "step-not-happened:charge", audit[0].Action)
	require.Equal(t, "ops", audit[0].Actor)

	_, _, err = e.greeter(t, "", "dead", "replay", ids[0], ids[1])
	require.NoError(t, err)
}

// Text from a job (its error, key, notes) cannot drive the operator's
// terminal or reorder what it shows: escape sequences and bidirectional
// overrides are printed as codes.
func TestJobTextCannotDriveTheTerminal(t *testing.T) {
	e := setup(t)
	pool := e.pool
	ctx := context.Background()
	j := e.enqueueGreet(t, "esc")
	_, err := pool.Exec(ctx, `UPDATE keel_jobs SET status = 'dead', error_class = 'permanent', finished_at = now(),
		last_error = $2 WHERE id = $1`, j.ID, "boom \x1b[2J\x1b]0;owned\x07 \u202edesrever")
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `INSERT INTO keel_steps (job_id, name, status) VALUES ($1, $2, 'started'), ($1, 'two words', 'started')`,
		j.ID, "pay\x1b[2J")
	require.NoError(t, err)
	for _, args := range [][]string{{"dead", "ls"}, {"dead", "show", j.ID}, {"status", "--id", j.ID}} {
		out, _, err := e.greeter(t, "", args...)
		require.NoError(t, err, "%v", args)
		require.NotContains(t, out, "\x1b", "%v", args)
		require.NotContains(t, out, "\x07", "%v", args)
		require.NotContains(t, out, "\u202e", "%v", args)
		require.Contains(t, out, "[U+001B]", "%v", args)
		require.Contains(t, out, "[U+202E]", "%v", args)
	}
	out, _, err := e.greeter(t, "", "dead", "show", j.ID)
	require.NoError(t, err)
	require.Contains(t, out, "say which on the job's dashboard page", "a step name that would drive the terminal is not offered as a command")
	require.Contains(t, out, "greeter dead resolve "+j.ID+" 'two words' --happened")
	// A refused replay names the step in doubt, on stderr.
	_, stderr, err := e.greeter(t, "", "dead", "replay", j.ID)
	require.Error(t, err)
	require.Contains(t, stderr, "pay[U+001B][2J")
	require.NotContains(t, stderr, "\x1b")

	// What enqueue prints of a key comes from its input.
	for _, dry := range []bool{false, true} {
		args := []string{"enqueue", "--from", "-"}
		if dry {
			args = append(args, "--dry-run")
		}
		out, _, err := e.keelApp(t, `{"kind": "cli:greet", "key": "k\u001b[2Jk", "payload": {"name": "x"}}`, args...)
		require.NoError(t, err)
		require.NotContains(t, out, "\x1b")
	}
	out, _, err = e.keelApp(t, "", "enqueue", "cli:greet", "k\x1b[2Jk", "--payload", `{"name": "x"}`)
	require.NoError(t, err)
	require.NotContains(t, out, "\x1b")
	require.Contains(t, out, "k[U+001B][2Jk")
	// And the refusal of such a key where the kind derives another.
	_, _, err = e.greeter(t, "", "enqueue", "cli:greet", "k\x1b[2Jk", "--payload", `{"name": "x"}`)
	require.Error(t, err)
	require.NotContains(t, err.Error(), "\x1b")
}

// enqueue says when a job it did not create keeps another payload, or is
// dead and stays so.
func TestEnqueueSaysWhatExistingJobsKeep(t *testing.T) {
	e := setup(t)
	pool := e.pool
	ctx := context.Background()
	in := `{"kind": "cli:greet", "key": "k1", "payload": {"name": "a"}}` + "\n" + `{"kind": "cli:greet", "key": "k1", "payload": {"name": "b"}}` + "\n"
	out, _, err := e.keelApp(t, in, "enqueue", "--from", "-")
	require.NoError(t, err)
	require.Contains(t, out, "1 created, 1 already existed")
	require.Contains(t, out, "1 of them existed with another payload, which the job keeps")

	_, err = pool.Exec(ctx, `UPDATE keel_jobs SET status = 'dead', finished_at = now() WHERE business_key = 'k1'`)
	require.NoError(t, err)
	out, _, err = e.keelApp(t, "", "enqueue", "cli:greet", "k1", "--payload", `{"name": "a"}`)
	require.NoError(t, err)
	require.Contains(t, out, "already existed (status dead")
	require.Contains(t, out, "keel dead replay")
	out, _, err = e.keelApp(t, `{"kind": "cli:greet", "key": "k1", "payload": {"name": "a"}}`, "enqueue", "--from", "-")
	require.NoError(t, err)
	require.Contains(t, out, "1 of them are dead jobs, which stay dead")
}

// healthcheck --json answers on stdout when it fails too.
func TestHealthcheckJSONSaysWhatFailed(t *testing.T) {
	root := cli.New(cli.App{Name: "keel"})
	var out bytes.Buffer
	root.SetOut(&out)
	root.SetErr(&bytes.Buffer{})
	root.SetArgs([]string{"--redis-url", "redis://127.0.0.1:1/0", "healthcheck", "--json", "--timeout", "2s"})
	err := root.ExecuteContext(context.Background())
	require.Error(t, err)
	var got struct {
		OK    bool   `json:"ok"`
		Error string `json:"error"`
	}
	require.NoError(t, json.Unmarshal(out.Bytes(), &got), out.String())
	require.False(t, got.OK)
	require.Contains(t, got.Error, "127.0.0.1:1")
}

// The error line says each thing once, on one line.
func TestErrorLine(t *testing.T) {
	// As pgx words a failed connection: one line per attempt (TLS, then plain).
	attempt := "127.0.0.1:1 (127.0.0.1): dial error: connection refused"
	err := errors.New("keel: Postgres at x is not answering: failed to connect to `user=postgres`:\n\t" + attempt + "\n\t" + attempt)
	require.Equal(t, "keel: Postgres at x is not answering: failed to connect to `user=postgres`: "+attempt, cli.ErrorLine("keel", err))
	require.Equal(t, "greeter: bad [U+001B] text", cli.ErrorLine("greeter", errors.New("keel: bad \x1b  text")))
	// A package's own prefix that already names the program is not doubled.
	require.Equal(t, "keel web: the password is empty", cli.ErrorLine("keel", errors.New("keel web: the password is empty")))
	require.Equal(t, "keel web: x", cli.ErrorLine("keel", errors.New("keel: keel web: x")))
	require.Equal(t, "greeter: keel web: x", cli.ErrorLine("greeter", errors.New("keel web: x")))
	require.Equal(t, "keel: keelhaul failed", cli.ErrorLine("keel", errors.New("keelhaul failed")))
}

// Help shows the URLs' defaults, which come from the environment: without
// their passwords, as errors show them.
func TestHelpHidesPasswordsFromTheEnvironment(t *testing.T) {
	t.Setenv("DATABASE_URL", "postgres://bob:s3cretpw@127.0.0.1:5432/keel")
	t.Setenv("REDIS_URL", "redis://:redispw@127.0.0.1:6379/0")
	root := cli.New(cli.App{Name: "greeter"})
	var out bytes.Buffer
	root.SetOut(&out)
	root.SetArgs([]string{"status", "--help"})
	require.NoError(t, root.Execute())
	require.NotContains(t, out.String(), "s3cretpw")
	require.NotContains(t, out.String(), "redispw")
	require.Contains(t, out.String(), "postgres://bob:xxxxx@127.0.0.1:5432/keel")

	// Only the password is hidden: the user name and host say which
	// database, as pgx's errors do.
	t.Setenv("DATABASE_URL", "")
	root = cli.New(cli.App{Name: "greeter"})
	out.Reset()
	root.SetOut(&out)
	root.SetArgs([]string{"status", "--help"})
	require.NoError(t, root.Execute())
	require.Contains(t, out.String(), `(default "`+cli.DefaultDatabaseURL+`")`)
	require.Contains(t, out.String(), `(default "postgres://postgres@127.0.0.1:5432/keel?sslmode=disable")`)

	// Every command's help, with every secret the environment can hold.
	secrets := map[string]string{"KEEL_METRICS_TOKEN": "tok-supersecret",
		"KEEL_ALERT_WEBHOOK": "https://hooks.slack.com/services/T0/B0/webhooksekrit",
		"KEEL_WEB_SECRET":    strings.Repeat("websekrit", 4), "KEEL_WEB_USERS": "ana:operator:$2a$12$usersekrit"}
	for k, v := range secrets {
		t.Setenv(k, v)
	}
	var walk func(path []string, c *cobra.Command)
	walk = func(path []string, c *cobra.Command) {
		root := cli.New(cli.App{Name: "greeter"})
		var out bytes.Buffer
		root.SetOut(&out)
		root.SetArgs(append(slices.Clone(path), "--help"))
		require.NoError(t, root.Execute())
		for _, v := range append(slices.Collect(maps.Values(secrets)), "s3cretpw", "redispw") {
			require.NotContains(t, out.String(), v, "greeter %s --help", strings.Join(path, " "))
		}
		for _, sub := range c.Commands() {
			walk(append(slices.Clone(path), sub.Name()), sub)
		}
	}
	walk(nil, cli.New(cli.App{Name: "greeter"}))
}

// A boolean variable reads 1, yes, TRUE… as true; one it cannot read is a
// usage error, not false.
func TestBooleanEnvironmentVariables(t *testing.T) {
	e := offline
	check := []string{"scheduler", "--check", "--config", "../examples/schedule.yaml"}
	for _, v := range []string{"1", "TRUE", "yes", "on"} {
		t.Setenv("KEEL_SCHEDULE_ANY_KIND", v)
		_, _, err := e.greeter(t, "", check...)
		require.NoError(t, err, "KEEL_SCHEDULE_ANY_KIND=%s", v)
	}
	for _, v := range []string{"0", "no", "false"} {
		t.Setenv("KEEL_SCHEDULE_ANY_KIND", v)
		_, _, err := e.greeter(t, "", check...)
		require.ErrorContains(t, err, "analytics:sync", "KEEL_SCHEDULE_ANY_KIND=%s", v)
	}
	t.Setenv("KEEL_SCHEDULE_ANY_KIND", "maybe")
	_, _, err := e.greeter(t, "", check...)
	require.ErrorContains(t, err, `KEEL_SCHEDULE_ANY_KIND="maybe": want true or false`)
	require.True(t, cli.IsUsageError(err))
	t.Setenv("KEEL_SCHEDULE_ANY_KIND", "")
	t.Setenv("KEEL_WEB_BEHIND_HTTPS", "si")
	_, _, err = e.greeter(t, "", "web", "--addr", "127.0.0.1:0")
	require.ErrorContains(t, err, `KEEL_WEB_BEHIND_HTTPS="si"`)
	_, _, err = e.greeter(t, "", check...)
	require.ErrorContains(t, err, "analytics:sync", "another command's variable is that command's business")
}

// The schedule check refuses what every tick would fail with: a queue no
// client takes, a payload that does not decode into the kind's type.
func TestScheduleCheckRefusesWhatTicksWouldFail(t *testing.T) {
	t.Parallel()
	e := offline
	for _, tc := range []struct{ entry, want string }{
		{"queue: nosuch\n    payload: {name: x}", `unknown queue "nosuch"`},
		{"payload: {name: x, extra: 1}", `payload does not decode into cli:greet's type`},
		{"payload: {name: 5}", `payload does not decode into cli:greet's type`},
	} {
		file := filepath.Join(t.TempDir(), "schedule.yaml")
		require.NoError(t, os.WriteFile(file, []byte("entries:\n  - name: greet\n    spec: \"@every 1m\"\n    kind: cli:greet\n    "+tc.entry+"\n"), 0o600))
		_, _, err := e.greeter(t, "", "scheduler", "--check", "--config", file)
		require.ErrorContains(t, err, tc.want, tc.entry)
		require.ErrorContains(t, err, `schedule entry "greet"`)
		require.NotContains(t, err.Error(), "enqueue many", "the check's own wording")
		require.NotContains(t, err.Error(), "0001-01-01", "a tick's key")
		require.True(t, cli.IsUsageError(err))
	}
	file := filepath.Join(t.TempDir(), "schedule.yaml")
	require.NoError(t, os.WriteFile(file, []byte("entries:\n  - name: greet\n    spec: \"@every 1m\"\n    kind: cli:greet\n    payload: {name: x}\n"), 0o600))
	out, _, err := e.greeter(t, "", "scheduler", "--check", "--config", file)
	require.NoError(t, err)
	require.Contains(t, out, "1 entries OK")
}

// ledger counts prunes of the last seven days only, and refuses a
// retention it cannot count against.
func TestLedgerFigures(t *testing.T) {
	e := setupAlone(t) // sets the environment
	pool := e.pool
	ctx := context.Background()
	_, err := pool.Exec(ctx, `DELETE FROM keel_prune_log`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `INSERT INTO keel_prune_log (at, rows) VALUES (now() - interval '1 hour', 3),
		(now() - interval '3 days', 40), (now() - interval '40 days', 5000)`)
	require.NoError(t, err)
	out, _, err := e.greeter(t, "", "ledger", "--json")
	require.NoError(t, err)
	var st struct {
		Pruned24h int64 `json:"pruned_last_24h"`
		Pruned7d  int64 `json:"pruned_last_7d"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &st))
	require.EqualValues(t, 3, st.Pruned24h)
	require.EqualValues(t, 43, st.Pruned7d, "a prune 40 days ago is not of the last 7 days")

	// Prunable now follows each kind's retention, as the prune does: a job
	// three days old under a policy of two counts, under the default 30 days.
	prunable := func() int64 {
		t.Helper()
		out, _, err := e.greeter(t, "", "ledger", "--json")
		require.NoError(t, err)
		var st struct {
			Prunable int64 `json:"prunable_now"`
		}
		require.NoError(t, json.Unmarshal([]byte(out), &st))
		return st.Prunable
	}
	before := prunable()
	_, err = pool.Exec(ctx, `INSERT INTO keel_jobs (id, kind, business_key, queue, payload, max_retry, status, finished_at)
		VALUES ('ledger-figures-1', 'figures:short', 'k1', 'default', '\x7b7d', 1, 'succeeded', now() - interval '3 days')`)
	require.NoError(t, err)
	require.Equal(t, before, prunable(), "within the default 30 days")
	require.NoError(t, ledger.SetRetention(ctx, pool, ledger.Policy{Kind: "figures:short", Status: "succeeded", Keep: 48 * time.Hour},
		"ops", "short", nil))
	require.Equal(t, before+1, prunable(), "past its kind's 2 days")

	for _, args := range [][]string{{"ledger", "--retention", "-24h"}, {"ledger", "--retention", "0s"}} {
		_, _, err = e.greeter(t, "", args...)
		require.ErrorContains(t, err, "--retention", "%v", args)
		require.True(t, cli.IsUsageError(err))
	}
	t.Setenv("KEEL_RETENTION", "30d")
	_, _, err = e.greeter(t, "", "ledger")
	require.ErrorContains(t, err, "KEEL_RETENTION")
	require.True(t, cli.IsUsageError(err))
}

// web says what is wrong with its address, and prints a one-time password
// only once it listens.
func TestWebStartUpMistakes(t *testing.T) {
	e := setup(t)
	_, _, err := e.greeter(t, "", "web", "--addr", "nonsense")
	require.ErrorContains(t, err, `--addr / KEEL_WEB_ADDR "nonsense": want host:port`)
	require.True(t, cli.IsUsageError(err))

	taken, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer taken.Close()
	_, stderr, err := e.greeter(t, "", "web", "--addr", taken.Addr().String())
	require.ErrorContains(t, err, "address already in use")
	require.NotContains(t, stderr, "password", "a password for a server that never started")
}

// keelCommand matches "keel <one of its commands>" in text a person reads.
var keelCommand = regexp.MustCompile("(^|[^\\w./-])keel (migrate|worker|relay|enqueue|status|ledger|dead|cancel|batch|web|scheduler|schedule|healthcheck|version)\\b")

// A program built with this package under its own name says its own name in
// its help and in the commands it tells a person to run next, not keel's:
// "keel dead replay" does not exist on a machine that has only "greeter".
func TestHelpAndHintsNameTheProgram(t *testing.T) {
	e := setup(t)
	pool := e.pool
	var walk func(c *cobra.Command)
	walk = func(c *cobra.Command) {
		for _, text := range []string{c.Short, c.Long, c.Example} {
			require.NotRegexp(t, keelCommand, text, "the help of %q", c.CommandPath())
		}
		for _, sub := range c.Commands() {
			walk(sub)
		}
	}
	walk(cli.New(testApp()))
	out, _, err := e.greeter(t, "", "status", "--help")
	require.NoError(t, err)
	require.Contains(t, out, "greeter status order:send_receipt order:123")

	// Its hints: a dead job enqueued again, and a dead job's step in doubt.
	j := e.enqueueGreet(t, "dead-hint")
	_, err = pool.Exec(context.Background(), `UPDATE keel_jobs SET status = 'dead', finished_at = now() WHERE id = $1`, j.ID)
	require.NoError(t, err)
	_, err = pool.Exec(context.Background(), `INSERT INTO keel_steps (job_id, name, status) VALUES ($1, 'mail', 'started')`, j.ID)
	require.NoError(t, err)
	out, _, err = e.greeter(t, "", "enqueue", "cli:greet", "--payload", `{"name": "dead-hint"}`)
	require.NoError(t, err)
	require.Contains(t, out, "greeter dead show "+j.ID)
	require.NotRegexp(t, keelCommand, out)
	out, _, err = e.greeter(t, "", "status", "--id", j.ID)
	require.NoError(t, err)
	require.Contains(t, out, "greeter dead resolve "+j.ID+" mail")
	require.NotRegexp(t, keelCommand, out)

	// A step its handler can Verify: a replay settles it.
	v := e.enqueueGreet(t, "verifiable")
	_, err = pool.Exec(context.Background(), `UPDATE keel_jobs SET status = 'dead', finished_at = now() WHERE id = $1`, v.ID)
	require.NoError(t, err)
	_, err = pool.Exec(context.Background(), `INSERT INTO keel_steps (job_id, name, status, verifiable) VALUES ($1, 'mail', 'started', true)`, v.ID)
	require.NoError(t, err)
	out, _, err = e.greeter(t, "", "status", "--id", v.ID)
	require.NoError(t, err)
	require.Contains(t, out, "its handler's Verify settles it when the job runs again: greeter dead replay "+v.ID)
	_, _, err = e.greeter(t, "", "dead", "replay", v.ID)
	require.NoError(t, err)
}

// A declared kind derives its business key from the payload: a key typed
// that differs (the order id for "order:123") would make a second job, and
// a second effect, for one action, so enqueue refuses it, from --from too.
func TestEnqueueRefusesAKeyTheKindDoesNotDerive(t *testing.T) {
	e := setup(t)
	pool := e.pool
	_, _, err := e.greeter(t, "", "enqueue", "cli:greet", "ann", "--payload", `{"name": "ann"}`)
	require.ErrorContains(t, err, `derives the business key "greet:ann" from this payload, not "ann"`)
	_, _, err = e.greeter(t, `{"kind": "cli:greet", "payload": {"name": "bo"}}`+"\n"+`{"kind": "cli:greet", "key": "bo", "payload": {"name": "bo"}}`+"\n",
		"enqueue", "--from", "-")
	require.ErrorContains(t, err, "line 2")
	require.ErrorContains(t, err, `"greet:bo"`)
	var n int
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT count(*) FROM keel_jobs WHERE business_key IN ('ann', 'bo', 'greet:ann', 'greet:bo')`).Scan(&n))
	require.Zero(t, n, "nothing enqueued")
	// The key it derives, given: fine.
	out, _, err := e.greeter(t, "", "enqueue", "cli:greet", "greet:ann", "--payload", `{"name": "ann"}`)
	require.NoError(t, err)
	require.Contains(t, out, "business key greet:ann")
}

// A line break or tab in a job's text cannot make status print a row of its
// own: a business key "k\nstatus  succeeded" must not show a pending job
// as succeeded at 3 a.m. Multi-line text (an error, a note) keeps its lines,
// indented under its own row.
func TestStatusRowsCannotBeForgedByJobText(t *testing.T) {
	e := setup(t)
	pool := e.pool
	ctx := context.Background()
	key := "k1\nstatus            succeeded\nlease             nobody"
	out, _, err := e.keelApp(t, "", "enqueue", "cli:greet", key, "--payload", `{"name": "forge"}`, "--delay", "1h", "--json")
	require.NoError(t, err)
	var j jobOut
	require.NoError(t, json.Unmarshal([]byte(out), &j))
	_, err = pool.Exec(ctx, `UPDATE keel_jobs SET status = 'dead', error_class = 'unknown', finished_at = now(),
		last_error = $2 WHERE id = $1`, j.ID, "first line\nstatus  discarded\n\tresolved by  ops")
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `INSERT INTO keel_steps (job_id, name, status) VALUES ($1, $2, 'started')`, j.ID, "mail\nstatus succeeded")
	require.NoError(t, err)
	for _, args := range [][]string{{"status", "cli:greet", key}, {"status", "--id", j.ID}, {"dead", "show", j.ID}} {
		out, _, err := e.keelApp(t, "", args...)
		require.NoError(t, err, "%v", args)
		var statusRows []string
		for _, line := range strings.Split(out, "\n") {
			if strings.HasPrefix(line, "status") || strings.HasPrefix(line, "lease") || strings.HasPrefix(line, "resolved by") {
				statusRows = append(statusRows, line)
			}
			require.False(t, strings.HasPrefix(line, "\t"), "%v: a line starts with a tab: %q", args, line)
		}
		require.Len(t, statusRows, 1, "%v: one status row, no forged ones:\n%s", args, out)
		require.Regexp(t, `^status +dead$`, statusRows[0], "%v", args)
		require.Contains(t, out, "first line", "%v", args)
	}
}

// dead show prints one line per audit entry: a note's line breaks (the
// dashboard's note is a textarea) cannot add an entry nobody made.
func TestDeadShowAuditNoteCannotForgeAnEntry(t *testing.T) {
	e := setup(t)
	pool := e.pool
	ctx := context.Background()
	j := e.enqueueGreet(t, "audited")
	_, err := pool.Exec(ctx, `UPDATE keel_jobs SET status = 'dead', error_class = 'permanent', finished_at = now() WHERE id = $1`, j.ID)
	require.NoError(t, err)
	note := "checked\naudit  2026-01-01T00:00:00Z  replay by the-boss: approved"
	_, _, err = e.greeter(t, "", "dead", "discard", j.ID, "--note", note, "--actor", "ops")
	require.NoError(t, err)
	out, _, err := e.greeter(t, "", "dead", "show", j.ID)
	require.NoError(t, err)
	var entries []string
	for _, line := range strings.Split(out, "\n") {
		if strings.HasPrefix(line, "audit") {
			entries = append(entries, line)
		}
	}
	require.Len(t, entries, 1, "one audit entry:\n%s", out)
	require.Contains(t, out, "approved", "the note is shown whole")
}

// A declared kind's payload is the business action: enqueue without one
// (a forgotten --payload, an empty shell variable, null) would enqueue the
// zero value's job — "greet:" for nobody — and take its key for good.
func TestEnqueueRefusesAMissingPayload(t *testing.T) {
	e := setup(t)
	pool := e.pool
	for _, args := range [][]string{
		{"enqueue", "cli:greet"},
		{"enqueue", "cli:greet", "--payload", ""},
		{"enqueue", "cli:greet", "--payload", " "},
		{"enqueue", "cli:greet", "--payload", "null"},
		{"enqueue", "cli:greet", "--dry-run"},
	} {
		_, _, err := e.greeter(t, "", args...)
		require.Error(t, err, "%q", args)
		require.True(t, cli.IsUsageError(err), "%q: %v", args, err)
		require.Contains(t, err.Error(), "payload", "%q", args)
	}
	for _, line := range []string{`{"kind": "cli:greet"}`, `{"kind": "cli:greet", "payload": null}`} {
		_, _, err := e.greeter(t, line+"\n", "enqueue", "--from", "-")
		require.ErrorContains(t, err, "line 1", line)
	}
	// An empty payload file is as empty.
	empty := filepath.Join(t.TempDir(), "empty.json")
	require.NoError(t, os.WriteFile(empty, nil, 0o600))
	_, _, err := e.greeter(t, "", "enqueue", "cli:greet", "--payload-file", empty)
	require.ErrorContains(t, err, "payload")
	var n int
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT count(*) FROM keel_jobs`).Scan(&n))
	require.Zero(t, n, "nothing was enqueued")

	// A kind the program does not declare keeps the {} default: keel
	// cannot know its payload.
	_, _, err = e.keelApp(t, "", "enqueue", "other:kind", "k1")
	require.NoError(t, err)
}

// What the text says of a step in doubt — a person must settle it, or the
// handler's Verify settles it on replay — the JSON says too, so a script can
// tell the jobs that need a person from those a replay settles.
func TestStatusJSONSaysWhetherAStepInDoubtNeedsAPerson(t *testing.T) {
	e := setup(t)
	pool := e.pool
	ctx := context.Background()
	j := e.enqueueGreet(t, "verify")
	_, err := pool.Exec(ctx, `UPDATE keel_jobs SET status = 'dead', error_class = 'transient', finished_at = now() WHERE id = $1`, j.ID)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `INSERT INTO keel_steps (job_id, name, status, verifiable) VALUES ($1, 'checked', 'started', true), ($1, 'blind', 'started', false)`, j.ID)
	require.NoError(t, err)
	for _, args := range [][]string{{"status", "--id", j.ID, "--json"}, {"dead", "show", j.ID, "--json"}, {"dead", "ls", "--json"}} {
		out, _, err := e.greeter(t, "", args...)
		require.NoError(t, err, "%v", args)
		require.Regexp(t, `"name": "checked",\s+"status": "started",[^}]*"verifiable": true`, out, "%v", args)
		require.Regexp(t, `"name": "blind",\s+"status": "started",[^}]*"verifiable": false`, out, "%v", args)
	}
}

// A filter given empty — `--kind "$KIND"` with KIND unset — selects nothing
// less than every dead job: with --yes a script would replay or discard all
// of them. It is refused as the mistake it is.
func TestBulkActionRefusesAnEmptyFilter(t *testing.T) {
	e := setup(t)
	pool := e.pool
	ctx := context.Background()
	for _, name := range []string{"a", "b"} {
		j := e.enqueueGreet(t, "empty-filter-"+name)
		_, err := pool.Exec(ctx, `UPDATE keel_jobs SET status = 'dead', error_class = 'permanent', finished_at = now() WHERE id = $1`, j.ID)
		require.NoError(t, err)
	}
	for _, flag := range []string{"--kind", "--queue", "--class", "--since", "--until"} {
		for _, action := range []string{"replay", "discard"} {
			for _, value := range []string{"", " "} {
				_, _, err := e.greeter(t, "", "dead", action, "--all", flag, value, "--yes", "--note", "cleanup")
				require.Error(t, err, "%s %s %q", action, flag, value)
				require.True(t, cli.IsUsageError(err), "%s %s %q: %v", action, flag, value, err)
				require.Contains(t, err.Error(), flag)
			}
		}
	}
	var dead int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM keel_jobs WHERE status = 'dead'`).Scan(&dead))
	require.Equal(t, 2, dead, "nothing was acted on")
}

// "Who has it?": a running job whose lease ran out is held by nobody — its
// worker probably died — as the dashboard says; status must not name that
// worker as the one running it.
func TestStatusSaysALeaseHasExpired(t *testing.T) {
	e := setup(t)
	pool := e.pool
	ctx := context.Background()
	live, gone := e.enqueueGreet(t, "lease-live"), e.enqueueGreet(t, "lease-gone")
	_, err := pool.Exec(ctx, `UPDATE keel_jobs SET status = 'running', attempts = 1, lease_holder = 'host/1/alive', lease_until = now() + interval '1 minute' WHERE id = $1`, live.ID)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `UPDATE keel_jobs SET status = 'running', attempts = 1, lease_holder = 'host/2/dead', lease_until = now() - interval '1 minute' WHERE id = $1`, gone.ID)
	require.NoError(t, err)
	out, _, err := e.greeter(t, "", "status", "--id", live.ID)
	require.NoError(t, err)
	require.Contains(t, out, "host/1/alive until")
	require.NotContains(t, out, "expired")
	out, _, err = e.greeter(t, "", "status", "--id", gone.ID)
	require.NoError(t, err)
	require.Regexp(t, `lease +host/2/dead until \S+ \(expired`, out)
}

// A note is bounded as on the dashboard (2,000 characters): the CLI took a
// note of any size into the job's row and audit log, which every page
// showing the job then carries.
func TestNotesAreBoundedAsOnTheDashboard(t *testing.T) {
	e := setup(t)
	pool := e.pool
	j := e.enqueueGreet(t, "long-note")
	_, err := pool.Exec(context.Background(), `UPDATE keel_jobs SET status = 'dead', error_class = 'permanent', finished_at = now() WHERE id = $1`, j.ID)
	require.NoError(t, err)
	long := strings.Repeat("é", 2001)
	for _, args := range [][]string{
		{"dead", "discard", j.ID, "--note", long},
		{"dead", "replay", j.ID, "--note", long},
		{"dead", "resolve", j.ID, "mail", "--happened", "--note", long},
		{"cancel", j.ID, "--note", long},
	} {
		_, _, err := e.greeter(t, "", args...)
		require.Error(t, err, args[:2])
		require.True(t, cli.IsUsageError(err), "%v: %v", args[:2], err)
		require.Contains(t, err.Error(), "2000", args[:2])
	}
	_, _, err = e.greeter(t, "", "dead", "discard", j.ID, "--note", strings.Repeat("é", 2000))
	require.NoError(t, err)
}

// A replayed job keeps its last error until it fails again: status says it
// is from an earlier attempt, as the dashboard does ("Earlier error"), and
// does not show it as why the job stands where it is.
func TestStatusShowsAnEarlierErrorAsHistory(t *testing.T) {
	e := setup(t)
	pool := e.pool
	j := e.enqueueGreet(t, "earlier")
	_, err := pool.Exec(context.Background(), `UPDATE keel_jobs SET status = 'dead', error_class = 'permanent', last_error = 'smtp said no', finished_at = now() WHERE id = $1`, j.ID)
	require.NoError(t, err)
	out, _, err := e.greeter(t, "", "status", "--id", j.ID)
	require.NoError(t, err)
	require.Regexp(t, `(?m)^last error +smtp said no$`, out)
	_, _, err = e.greeter(t, "", "dead", "replay", j.ID)
	require.NoError(t, err)
	out, _, err = e.greeter(t, "", "status", "--id", j.ID)
	require.NoError(t, err)
	require.Regexp(t, `(?m)^status +pending$`, out)
	require.NotRegexp(t, `(?m)^last error`, out, "the pending job has no current error")
	require.Regexp(t, `(?m)^earlier error +smtp said no \(permanent; from an earlier attempt`, out)
}

// status does not promise the kind's whole budget to a job failing with an
// unclassified error: the worker's policy retries those 3 times by default.
func TestStatusSaysAnUnclassifiedFailureHasAShorterBudget(t *testing.T) {
	e := setup(t)
	pool := e.pool
	j := e.enqueueGreet(t, "unclassified")
	_, err := pool.Exec(context.Background(), `UPDATE keel_jobs SET status = 'failed', attempts = 2, max_retry = 8, error_class = 'unknown',
		last_error = 'weird', run_at = now() + interval '1 minute' WHERE id = $1`, j.ID)
	require.NoError(t, err)
	out, _, err := e.greeter(t, "", "status", "--id", j.ID)
	require.NoError(t, err)
	require.Regexp(t, `(?m)^attempts +2 \(max retry 8; .*dies after attempt 4`, out)
}

// status says when keel added runs to a job's budget, and why: a run of it
// crashed beside other jobs, and it runs alone before it can be retired.
func TestStatusSaysKeelAddedARunAfterACrashBesideOthers(t *testing.T) {
	e := setup(t)
	pool := e.pool
	j := e.enqueueGreet(t, "crashed-beside")
	_, err := pool.Exec(context.Background(), `UPDATE keel_jobs SET status = 'failed', attempts = 1, max_retry = 0, extra_runs = 1,
		crashes = 1, run_at = now() WHERE id = $1`, j.ID)
	require.NoError(t, err)
	out, _, err := e.greeter(t, "", "status", "--id", j.ID)
	require.NoError(t, err)
	require.Regexp(t, `(?m)^attempts +1 \(max retry 0; 1 run\(s\) added by keel, since a run crashed beside other jobs: it runs alone`, out)
	out, _, err = e.greeter(t, "", "status", "--id", j.ID, "--json")
	require.NoError(t, err)
	require.Contains(t, out, `"extra_runs": 1`)
}

// Discarding a job that has not finished is refused, and the refusal says
// what stops such a job: cancel.
func TestDiscardOfAnOpenJobPointsToCancel(t *testing.T) {
	e := setup(t)
	j := e.enqueueGreet(t, "still-open")
	_, stderr, err := e.greeter(t, "", "dead", "discard", j.ID, "--note", "stop it")
	require.Error(t, err)
	require.Contains(t, stderr, "`greeter cancel "+j.ID+"`")
	out, _, err := e.greeter(t, "", "dead", "discard", j.ID, "--note", "stop it", "--json")
	require.Error(t, err)
	require.Contains(t, out, "greeter cancel "+j.ID)
}

// dead ls prints one line per job, whatever its kind holds: the key and
// error are kept to one line already, and so is the kind.
func TestDeadLsKeepsEachJobOnOneLine(t *testing.T) {
	e := setup(t)
	pool := e.pool
	out, _, err := e.keelApp(t, "", "enqueue", "odd\nkind\tx", "k1", "--payload", `{}`, "--json")
	require.NoError(t, err)
	var j jobOut
	require.NoError(t, json.Unmarshal([]byte(out), &j))
	_, err = pool.Exec(context.Background(), `UPDATE keel_jobs SET status = 'dead', error_class = 'permanent', last_error = 'boom', finished_at = now() WHERE id = $1`, j.ID)
	require.NoError(t, err)
	out, _, err = e.keelApp(t, "", "dead", "ls")
	require.NoError(t, err)
	lines := strings.Split(strings.TrimSpace(out), "\n")
	require.Len(t, lines, 3, "header, the job, the count:\n%s", out)
	require.Contains(t, lines[1], j.ID)
}

// What enqueue prints of a job stays on its line: a line break in a kind or
// key shows as a code.
func TestEnqueueOutputKeepsAJobOnItsLine(t *testing.T) {
	e := setup(t)
	for _, dry := range []bool{false, true} {
		args := []string{"enqueue", "two\nlines", "k\nstatus dead", "--payload", `{}`}
		if dry {
			args = append(args, "--dry-run")
		}
		out, _, err := e.keelApp(t, "", args...)
		require.NoError(t, err)
		for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
			require.False(t, strings.HasPrefix(line, "status") || strings.HasPrefix(line, "lines"), "dry run %v: %q", dry, out)
		}
		require.Contains(t, out, "k[U+000A]status dead", "dry run %v", dry)
	}
}

// --all reads every dead job the filter matches, past a thousand too, each
// once: the ids are read in one statement, not in pages that a job dying or
// leaving meanwhile would shift.
func TestBulkActionSelectsEveryDeadJobOnce(t *testing.T) {
	e := setup(t)
	pool := e.pool
	ctx := context.Background()
	const n = 1003
	_, err := pool.Exec(ctx, `INSERT INTO keel_jobs (id, kind, business_key, queue, payload, max_retry, status, error_class, finished_at)
		SELECT gen_random_uuid()::text, 'cli:greet', 'many-' || g, 'default', '{"name": "many"}', 3, 'dead', 'permanent',
			now() - g * interval '1 second' FROM generate_series(1, $1) g`, n)
	require.NoError(t, err)
	out, _, err := e.greeter(t, "", "dead", "replay", "--all", "--kind", "cli:greet", "--dry-run", "--json")
	require.NoError(t, err)
	var dry struct {
		Count int      `json:"count"`
		IDs   []string `json:"ids"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &dry))
	require.Equal(t, n, dry.Count)
	seen := map[string]bool{}
	for _, id := range dry.IDs {
		require.False(t, seen[id], "job %s selected twice", id)
		seen[id] = true
	}
	require.Len(t, seen, n)
}

// A filter value pasted with spaces around it means what the dashboard's
// filter takes it to mean, not "nothing matches".
func TestDeadFiltersIgnoreSurroundingSpaces(t *testing.T) {
	e := setup(t)
	pool := e.pool
	j := e.enqueueGreet(t, "spaced-filter")
	_, err := pool.Exec(context.Background(), `UPDATE keel_jobs SET status = 'dead', error_class = 'permanent', finished_at = now() WHERE id = $1`, j.ID)
	require.NoError(t, err)
	out, _, err := e.greeter(t, "", "dead", "ls", "--kind", " cli:greet ", "--queue", "default ", "--class", " permanent", "--json")
	require.NoError(t, err)
	require.Contains(t, out, j.ID)
}

// hash-password refuses a password short enough to be among a guesser's
// first tries, and hashes one that is not.
// Not parallel: it swaps the command's hash function.
func TestHashPasswordRefusesAShortPassword(t *testing.T) {
	e := offline
	_, _, err := e.greeter(t, "pw123\n", "web", "hash-password")
	require.Error(t, err)
	require.True(t, cli.IsUsageError(err), "%v", err)
	require.ErrorContains(t, err, "at least 8")
	// The command hashes with web.HashPassword, whose cost web's tests
	// check; a hash at that cost takes seconds under the race detector,
	// so here the command gets a cheap one, and the line it reads.
	require.True(t, cli.HashesWithWebHashPassword(), "hash-password hashes with web.HashPassword")
	var got []string
	cli.SetHashPassword(t, func(password []byte) (string, error) {
		got = append(got, string(password))
		h, err := bcrypt.GenerateFromPassword(password, bcrypt.MinCost)
		return string(h), err
	})
	out, _, err := e.greeter(t, "correct horse battery\n", "web", "hash-password")
	require.NoError(t, err)
	require.Equal(t, []string{"correct horse battery"}, got, "the first line, without its newline")
	require.True(t, strings.HasPrefix(out, "$2a$"), out)
	require.NoError(t, bcrypt.CompareHashAndPassword([]byte(strings.TrimSuffix(out, "\n")), []byte("correct horse battery")))
}

// A look-up that finds nothing says what was likely mistyped: the shape of
// the kind's keys (order:123, not 123), or the kinds the ledger holds.
func TestStatusNotFoundSaysWhatKeysLookLike(t *testing.T) {
	e := setup(t)
	j := e.enqueueGreet(t, "shape")
	_, _, err := e.greeter(t, "", "status", "cli:greet", "shape-typo")
	require.ErrorIs(t, err, idempotency.ErrNotFound)
	require.ErrorContains(t, err, `its newest job's key is "`)
	_, _, err = e.greeter(t, "", "status", "cli:nosuch", "x")
	require.ErrorIs(t, err, idempotency.ErrNotFound)
	require.ErrorContains(t, err, "the ledger holds no job of that kind; its kinds: ")
	require.ErrorContains(t, err, j.Kind)
	_, _, err = e.greeter(t, "", "status", "cli:greet", "")
	require.True(t, cli.IsUsageError(err), "%v", err)
}

// migrate --print shows a DBA the SQL the ledger lacks, in order, and
// changes nothing; --check says whether anything is missing, and changes
// nothing either.
func TestMigratePrintsAndChecksWithoutChangingAnything(t *testing.T) {
	e := setup(t)
	pool := e.pool
	ctx := context.Background()
	db := []string{"--database-url", e.databaseURL()}
	run := func(args ...string) (string, error) {
		out, _, err := e.greeter(t, "", append(args, db...)...)
		return out, err
	}
	out, err := run("migrate", "--check")
	require.NoError(t, err)
	require.Contains(t, out, "current")

	ms, err := migrate.All()
	require.NoError(t, err)
	newest := ms[len(ms)-1]
	_, err = pool.Exec(ctx, `DELETE FROM keel_schema_migrations WHERE version = $1`, newest.Version)
	require.NoError(t, err)
	_, err = run("migrate", "--check")
	require.ErrorContains(t, err, newest.Name)
	out, err = run("migrate", "--check", "--json")
	require.Error(t, err)
	require.JSONEq(t, `{"current": false, "missing": ["`+newest.Name+`"]}`, out)

	out, err = run("migrate", "--print")
	require.NoError(t, err)
	require.Contains(t, out, "-- "+newest.Name+": run ")
	require.Contains(t, out, strings.TrimSpace(newest.SQL))
	require.NotContains(t, out, ms[0].Name, "an applied migration was printed")
	_, err = run("migrate", "--check")
	require.Error(t, err, "--print changed the schema")
	out, err = run("migrate", "--print", "--json")
	require.NoError(t, err)
	var printed struct {
		Migrations []struct {
			Name string `json:"name"`
			SQL  string `json:"sql"`
		} `json:"migrations"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &printed))
	require.Len(t, printed.Migrations, 1)
	require.Equal(t, newest.SQL, printed.Migrations[0].SQL)

	_, err = run("migrate")
	require.NoError(t, err)
	_, err = run("migrate", "--check")
	require.NoError(t, err)

	// A schema keel never migrated lacks every migration.
	out, _, err = e.greeter(t, "", "migrate", "--print", "--database-url", testenv.URL("keel_test_cli_never_migrated"))
	require.NoError(t, err)
	for _, m := range ms {
		require.Contains(t, out, "-- "+m.Name+": run ")
	}
	_, _, err = e.greeter(t, "", "migrate", "--print", "--check")
	require.Error(t, err)
	require.True(t, cli.IsUsageError(err), "%v", err)
}

// A payload that is not UTF-8 would give the key of another ("greet:\uFFFD"
// for two names): two actions, one job. enqueue refuses it, declared kind
// or not, on the command line and in --from lines.
func TestEnqueueRefusesAPayloadThatIsNotUTF8(t *testing.T) {
	e := setup(t)
	pool := e.pool
	for _, payload := range []string{"{\"name\": \"\xff\"}", `{"name": "\udc00"}`} {
		for _, args := range [][]string{
			{"enqueue", "cli:greet", "--payload", payload},
			{"enqueue", "cli:greet", "--payload", payload, "--dry-run"},
		} {
			_, _, err := e.greeter(t, "", args...)
			require.True(t, cli.IsUsageError(err), "%q: %v", args, err)
			require.ErrorContains(t, err, "UTF-8", "%q", args)
		}
		_, _, err := e.greeter(t, `{"kind": "cli:greet", "payload": `+payload+"}\n", "enqueue", "--from", "-")
		require.ErrorContains(t, err, "line 1", payload)
		require.ErrorContains(t, err, "UTF-8", payload)
	}
	_, _, err := e.keelApp(t, "", "enqueue", "other:kind", "k1", "--payload", "{\"any\": \"\xff\"}")
	require.True(t, cli.IsUsageError(err), "%v", err)
	require.ErrorContains(t, err, "UTF-8")
	var n int
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT count(*) FROM keel_jobs`).Scan(&n))
	require.Zero(t, n, "nothing was enqueued")
}
