package cli_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/cli"
	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/jobstore"
	"github.com/keeljobs/keel/internal/testenv"
	"github.com/keeljobs/keel/migrate"
)

var (
	buildOnce sync.Once
	buildDir  string
	buildErr  error
	buildHead string // the checkout's revision, when the tests run in one
)

// welcomeBinary builds the README's program (examples/welcome) once per
// test run, the way a team builds its own binary.
func welcomeBinary(t *testing.T) string {
	t.Helper()
	buildOnce.Do(func() {
		buildDir, buildErr = os.MkdirTemp("", "keel-cli-test")
		if buildErr != nil {
			return
		}
		// Embed the VCS revision whatever GOFLAGS says, when there is one.
		// go build stamps only a checkout whose .git is a directory: not a
		// git worktree's, where .git is a file.
		vcs := "-buildvcs=auto"
		if head, err := exec.Command("git", "rev-parse", "HEAD").Output(); err == nil {
			top, _ := exec.Command("git", "rev-parse", "--show-toplevel").Output()
			if fi, err := os.Stat(filepath.Join(strings.TrimSpace(string(top)), ".git")); err == nil && fi.IsDir() {
				vcs, buildHead = "-buildvcs=true", strings.TrimSpace(string(head))
			}
		}
		out, err := testenv.GoBuild(vcs, "-o", buildDir, "../examples/welcome").CombinedOutput()
		if err != nil {
			buildErr = errors.New(string(out))
		}
	})
	require.NoError(t, buildErr)
	return filepath.Join(buildDir, "welcome")
}

type run struct {
	stdout, stderr string
	code           int
}

// welcome runs the built binary with args and env (besides the test's
// PATH), bounded by a minute from when the binary is built: on a busy host
// the build alone can take that long.
func welcome(t *testing.T, env []string, args ...string) run {
	t.Helper()
	bin := welcomeBinary(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Env = append([]string{"PATH=" + os.Getenv("PATH"), testenv.NoRaceExitSleep, "HOME=" + os.Getenv("HOME")}, env...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	code := 0
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		code = ee.ExitCode()
	} else {
		require.NoError(t, err)
	}
	return run{stdout: stdout.String(), stderr: stderr.String(), code: code}
}

// closedPort is a loopback address nothing listens on.
func closedPort(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := l.Addr().String()
	require.NoError(t, l.Close())
	return addr
}

// The README's "Your own worker binary": fifteen lines that get keel's
// subcommands for their own kind. Built with go build, then run: version,
// enqueue, and a worker that runs the job.
func TestYourOwnBinary(t *testing.T) {
	e := setup(t)
	pool := e.pool
	env := []string{"REDIS_URL=" + e.redisURL(), "DATABASE_URL=" + e.databaseURL()}

	r := welcome(t, env, "version")
	require.Equal(t, 0, r.code, r.stderr)
	require.Regexp(t, `^welcome \S+.*, ledger schema \d+, go\d`, r.stdout)
	r = welcome(t, env, "version", "--json")
	require.Equal(t, 0, r.code, r.stderr)
	var v cli.VersionInfo
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &v))
	require.Equal(t, "welcome", v.Program)
	require.Equal(t, migrate.Version(), v.LedgerSchema)
	require.NotEmpty(t, v.Version)
	if buildHead != "" {
		require.Equal(t, buildHead, v.Revision, "go build embeds the checkout's revision")
		require.Contains(t, r.stdout, `"revision_time"`)
	}

	r = welcome(t, env, "migrate")
	require.Equal(t, 0, r.code, r.stderr)
	r = welcome(t, env, "healthcheck")
	require.Equal(t, 0, r.code, r.stderr)
	require.Contains(t, r.stdout, "ok")

	// The business key comes from the kind's Key.
	r = welcome(t, env, "enqueue", "user:send_welcome", "--payload", `{"user_id":"42"}`, "-o", "json")
	require.Equal(t, 0, r.code, r.stderr)
	var res struct {
		ID          string `json:"id"`
		BusinessKey string `json:"business_key"`
		Queue       string `json:"queue"`
		Existed     bool   `json:"existed"`
	}
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &res))
	require.Equal(t, "user:42", res.BusinessKey)
	require.Equal(t, "default", res.Queue)
	require.False(t, res.Existed)

	// Asked for JSON, a failure answers JSON on stdout too.
	for _, tc := range []struct {
		args  []string
		code  int
		usage bool
	}{
		{[]string{"status", "user:send_welcome", "user:nobody", "--json"}, 1, false},
		{[]string{"dead", "ls", "--limit", "0", "-o", "json"}, 2, true},
	} {
		r = welcome(t, env, tc.args...)
		require.Equal(t, tc.code, r.code, r.stderr)
		var failed struct {
			Error      string `json:"error"`
			UsageError bool   `json:"usage_error"`
		}
		require.NoError(t, json.Unmarshal([]byte(r.stdout), &failed), "stdout %q", r.stdout)
		require.Equal(t, strings.TrimSpace(r.stderr), failed.Error)
		require.Equal(t, tc.usage, failed.UsageError)
	}
	r = welcome(t, env, "status", "user:send_welcome", "user:nobody")
	require.Empty(t, r.stdout, "text output prints errors on stderr only")

	r = welcome(t, env, "enqueue", "user:send_goodbye", "user:42")
	require.Equal(t, 2, r.code)
	require.Equal(t, "welcome: welcome does not declare the kind \"user:send_goodbye\" (its kinds: user:send_welcome)\n", r.stderr)
	r = welcome(t, env, "enqueue", "user:send_welcome", "--payload", `{"user_id": 42}`)
	require.Equal(t, 2, r.code)
	require.Contains(t, r.stderr, "payload does not decode into user:send_welcome's type main.Welcome")
	r = welcome(t, env, "enqueue", "user:send_welcome", "--payload", `{"userid": "42"}`)
	require.Equal(t, 2, r.code)
	require.Contains(t, r.stderr, `unknown field "userid"`)

	// The worker runs the program's handler.
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	worker := exec.CommandContext(ctx, welcomeBinary(t), "worker", "--queues", "default:1", "--shutdown-timeout", "2s")
	worker.Env = append([]string{"PATH=" + os.Getenv("PATH"), testenv.NoRaceExitSleep}, env...)
	var werr testenv.SyncBuffer
	worker.Stderr = &werr
	require.NoError(t, worker.Start())
	store := jobstore.NewStore(pool)
	testenv.Eventually(t, 30*time.Second, func() bool {
		j, err := store.Get(context.Background(), res.ID)
		return err == nil && j.Status == idempotency.StatusSucceeded
	}, "the worker never ran the job")
	require.NoError(t, worker.Process.Signal(syscall.SIGTERM))
	require.NoError(t, worker.Wait(), werr.String())
	require.Contains(t, werr.String(), "user=42", "the handler logged")
	require.NotContains(t, werr.String(), "pool is smaller", "the worker sizes its pool for its concurrency")
}

// JSON asked for anywhere on the line answers a mistake found before it
// was read (a flag cobra does not know) in JSON too.
func TestJSONAskedAfterABadFlag(t *testing.T) {
	for _, args := range [][]string{
		{"status", "--frob", "--json"},
		{"status", "--frob", "-o", "json"},
		{"--frob", "dead", "ls", "--output=json"},
		{"enqueue", "--delay", "soon", "--json=true"},
	} {
		r := welcome(t, nil, args...)
		require.Equal(t, 2, r.code, "%q: %s", args, r.stderr)
		var failed struct {
			Error      string `json:"error"`
			UsageError bool   `json:"usage_error"`
		}
		require.NoError(t, json.Unmarshal([]byte(r.stdout), &failed), "%q: stdout %q", args, r.stdout)
		require.Equal(t, strings.TrimSpace(r.stderr), failed.Error)
		require.True(t, failed.UsageError, "%q", args)
	}
	for _, args := range [][]string{{"status", "--frob"}, {"status", "--frob", "--json=false"}, {"status", "--frob", "--", "--json"}} {
		r := welcome(t, nil, args...)
		require.Equal(t, 2, r.code, "%q: %s", args, r.stderr)
		require.Empty(t, r.stdout, "%q: no JSON asked for", args)
	}
}

// Unreachable Redis, a Redis database the server does not have, a ledger
// without the schema and a database that does not exist: one line on
// stderr that says which, exit status 1, nothing else.
func TestFailsFastWithOneClearLine(t *testing.T) {
	e := setup(t) // migrated, for the Redis cases
	const empty = "keel_test_cli_noschema"
	_, err := testenv.PoolConfig(context.Background(), empty) // a fresh schema, not migrated
	require.NoError(t, err)
	good := e.databaseURL()
	down := "redis://" + closedPort(t) + "/0"
	const id = "01936f3e-8c1a-7b2e-9f00-1a2b3c4d5e6f"

	oneLine := func(t *testing.T, r run, want string) {
		t.Helper()
		require.Equal(t, 1, r.code, "stdout %q stderr %q", r.stdout, r.stderr)
		require.Equal(t, 1, strings.Count(r.stderr, "\n"), "one line, got:\n%s", r.stderr)
		require.True(t, strings.HasPrefix(r.stderr, "welcome: "), r.stderr)
		require.Contains(t, r.stderr, want)
		require.NotContains(t, r.stderr, "pool.go")
	}

	for _, args := range [][]string{
		{"worker"}, {"enqueue", "user:send_welcome", "--payload", `{"user_id":"1"}`},
		{"dead", "replay", id}, {"dead", "discard", id, "--note", "n"}, {"cancel", id}, {"scheduler", "--config", "../examples/schedule.yaml", "--allow-unknown-kinds"},
		{"relay"}, {"healthcheck"},
	} {
		t.Run("redis down/"+args[0], func(t *testing.T) {
			t.Parallel() // each waits out the CLI's wait for a Redis that never answers
			oneLine(t, welcome(t, []string{"REDIS_URL=" + down, "DATABASE_URL=" + good}, args...), "Redis at "+down+" is not answering")
		})
	}
	// The dashboard's own pages read the ledger: it starts without Redis,
	// says so, and serves them.
	t.Run("redis down/web", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		addr := closedPort(t)
		web := exec.CommandContext(ctx, welcomeBinary(t), "web", "--addr", addr)
		web.Env = []string{"PATH=" + os.Getenv("PATH"), testenv.NoRaceExitSleep, "HOME=" + os.Getenv("HOME"), "REDIS_URL=" + down, "DATABASE_URL=" + good}
		var werr testenv.SyncBuffer
		web.Stderr = &werr
		require.NoError(t, web.Start())
		defer func() { _ = web.Process.Kill(); _ = web.Wait() }()
		testenv.Eventually(t, 20*time.Second, func() bool {
			res, err := http.Get("http://" + addr + "/login")
			if err != nil {
				return false
			}
			res.Body.Close()
			return res.StatusCode == http.StatusOK
		}, "the dashboard did not start without Redis: %s", werr.String())
		require.Contains(t, werr.String(), "starting without Redis")
	})
	t.Run("redis database out of range", func(t *testing.T) {
		for _, args := range [][]string{{"enqueue", "user:send_welcome", "--payload", `{"user_id":"1"}`}, {"worker"}, {"web", "--addr", "127.0.0.1:0"}} {
			r := welcome(t, []string{"REDIS_URL=redis://" + e.redis.Addr + "/99", "DATABASE_URL=" + good}, args...)
			oneLine(t, r, "has no such database")
			require.Contains(t, r.stderr, "DB index is out of range")
		}
	})
	for _, args := range [][]string{
		{"status", "user:send_welcome", "user:1"}, {"status", "--id", id}, {"enqueue", "user:send_welcome", "--payload", `{"user_id":"1"}`},
		{"dead", "ls"}, {"dead", "show", id}, {"cancel", id}, {"ledger"}, {"worker"}, {"web", "--addr", "127.0.0.1:0"}, {"relay"}, {"healthcheck"},
	} {
		t.Run("no schema/"+strings.Join(args[:min(2, len(args))], " "), func(t *testing.T) {
			oneLine(t, welcome(t, []string{"REDIS_URL=" + e.redisURL(), "DATABASE_URL=" + testenv.URL(empty)}, args...),
				"the ledger has no schema yet: run `welcome migrate`")
		})
	}
	t.Run("no database", func(t *testing.T) {
		u := strings.Replace(testenv.DatabaseURL(), "/keel_test?", "/keel_test_no_such_database?", 1)
		require.NotEqual(t, testenv.DatabaseURL(), u, "the test database URL has an unexpected shape")
		for _, args := range [][]string{{"status", "user:send_welcome", "user:1"}, {"worker"}} {
			r := welcome(t, []string{"REDIS_URL=" + e.redisURL(), "DATABASE_URL=" + u}, args...)
			oneLine(t, r, `database "keel_test_no_such_database" does not exist: run `+"`welcome migrate`")
			require.NotContains(t, r.stderr, "not answering")
		}
	})
}

func itoa(n int) string { return strconv.Itoa(n) }
