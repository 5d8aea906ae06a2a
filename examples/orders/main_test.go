package main

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	"go.yaml.in/yaml/v3"

	"github.com/keeljobs/keel/cli"
	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/inspect"
	"github.com/keeljobs/keel/internal/testenv"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// ordersCLI runs the example's CLI in-process against the Redis at
// redisAddr and the ledger in schema.
func ordersCLI(redisAddr, schema string) func(t *testing.T, stdin string, args ...string) (string, error) {
	return func(t *testing.T, stdin string, args ...string) (string, error) {
		t.Helper()
		root := cli.New(app())
		var out bytes.Buffer
		root.SetOut(&out)
		root.SetErr(&out)
		root.SetIn(strings.NewReader(stdin))
		root.SetArgs(append([]string{"--redis-url", "redis://" + redisAddr + "/0",
			"--database-url", testenv.URL(schema), "--log-level", "error"}, args...))
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		err := root.ExecuteContext(ctx)
		return out.String(), err
	}
}

func itoa(n int) string { return strconv.Itoa(n) }

// statusJSON is the part of `status --json` these tests read.
type statusJSON struct {
	ID     string `json:"id"`
	Status string `json:"status"`
	Queue  string `json:"queue"`
}

func TestCLI(t *testing.T) {
	t.Parallel()
	pool, schema := testenv.PrivatePool(t) // migrate below must be a no-op
	orders := ordersCLI(testenv.StartRedis(t).Addr(), schema)
	ctx := context.Background()

	out, err := orders(t, "", "version")
	require.NoError(t, err)
	require.Regexp(t, `^orders \S+.*, ledger schema \d+, go`, out)

	out, err = orders(t, "", "migrate")
	require.NoError(t, err)
	require.Contains(t, out, "ledger schema is current")
	var orderTables bool
	require.NoError(t, pool.QueryRow(ctx, `SELECT to_regclass('keel_example_orders') IS NOT NULL`).Scan(&orderTables))
	require.True(t, orderTables, "migrate creates the example's own tables too")

	out, err = orders(t, "", "enqueue", "order:send_receipt", "order:cli", "--payload", `{"order_id":"cli","email":"a@example.com"}`)
	require.NoError(t, err)
	require.Contains(t, out, "created")
	out, err = orders(t, "", "enqueue", "order:send_receipt", "order:cli", "--payload", `{"order_id":"cli","email":"a@example.com"}`)
	require.NoError(t, err)
	require.Contains(t, out, "already existed")
	_, err = orders(t, "", "enqueue", "order:send_receipt", "k", "--payload", `{not json`)
	require.ErrorContains(t, err, "not valid JSON")
	_, err = orders(t, "", "enqueue", "order:send_receipt", "--queue", "nope", "--payload", `{"order_id":"q","email":"a@example.com"}`)
	require.ErrorContains(t, err, `unknown queue "nope"`)
	_, err = orders(t, "", "enqueue", "order:refund", "k")
	require.ErrorContains(t, err, `orders does not declare the kind "order:refund"`)
	_, err = orders(t, "", "enqueue", "order:send_receipt", "k", "--payload", `{"order_id": 7}`)
	require.ErrorContains(t, err, "payload does not decode into order:send_receipt's type")

	out, err = orders(t, "", "status", "order:send_receipt", "order:cli", "--json")
	require.NoError(t, err)
	var st statusJSON
	require.NoError(t, json.Unmarshal([]byte(out), &st))
	require.Equal(t, "pending", st.Status)
	require.Equal(t, "critical", st.Queue)
	out, err = orders(t, "", "status", "--id", st.ID)
	require.NoError(t, err)
	require.Contains(t, out, "order:cli")
	_, err = orders(t, "", "status", "order:send_receipt", "order:nope")
	require.ErrorIs(t, err, idempotency.ErrNotFound)
	_, err = orders(t, "", "status")
	require.Error(t, err)
	_, err = orders(t, "", "status", "--id", "not-a-uuid")
	require.ErrorContains(t, err, "malformed")

	// Dead letters: make two dead jobs, then list, discard and replay them.
	_, err = pool.Exec(ctx, `UPDATE keel_jobs SET status = 'dead', last_error = '<script>x</script> boom', error_class = 'permanent',
		finished_at = now() WHERE id = $1`, st.ID)
	require.NoError(t, err)
	_, err = orders(t, "", "enqueue", "analytics:sync", "order:cli2", "--payload", `{"order_id":"cli2"}`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `UPDATE keel_jobs SET status = 'dead', last_error = 'timeout', error_class = 'transient',
		finished_at = now() WHERE business_key = 'order:cli2'`)
	require.NoError(t, err)

	out, err = orders(t, "", "dead", "ls")
	require.NoError(t, err)
	require.Contains(t, out, "2 dead job(s) match")
	out, err = orders(t, "", "dead", "ls", "--class", "permanent", "--json")
	require.NoError(t, err)
	var ls struct {
		Total int          `json:"total"`
		Jobs  []statusJSON `json:"jobs"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &ls))
	require.Equal(t, 1, ls.Total)
	require.Equal(t, st.ID, ls.Jobs[0].ID)

	_, err = orders(t, "", "dead", "discard", st.ID)
	require.ErrorIs(t, err, inspect.ErrNoteRequired)
	out, err = orders(t, "", "dead", "discard", "--all", "--class", "permanent", "--note", "customer left", "--dry-run")
	require.NoError(t, err)
	require.Contains(t, out, "dry run: would discard 1 job(s); nothing was changed")
	_, err = orders(t, "2\n", "dead", "discard", "--all", "--class", "permanent", "--note", "customer left")
	require.ErrorContains(t, err, "not confirmed")
	out, err = orders(t, "1\n", "dead", "discard", "--all", "--class", "permanent", "--note", "customer left", "--actor", "ops:ann")
	require.NoError(t, err)
	require.Contains(t, out, "1 done, 0 unchanged, 0 failed")
	out, err = orders(t, "", "dead", "show", st.ID)
	require.NoError(t, err)
	require.Contains(t, out, "discarded")
	require.Regexp(t, regexp.MustCompile(`audit .* discard by ops:ann: customer left`), out)

	out, err = orders(t, "", "dead", "replay", "--all", "--yes")
	require.NoError(t, err)
	require.Contains(t, out, "1 done, 0 unchanged, 0 failed")
	ops, err := inspect.New(inspect.Config{Pool: pool})
	require.NoError(t, err)
	j, err := ops.Lookup(ctx, "analytics:sync", "order:cli2")
	require.NoError(t, err)
	require.Equal(t, idempotency.StatusPending, j.Status)
	require.Equal(t, 0, j.Attempts, "a replay gets a fresh budget")

	out, err = orders(t, "", "ledger", "--json")
	require.NoError(t, err)
	var ls2 struct {
		Rows map[string]int64 `json:"rows_by_status"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &ls2))
	require.EqualValues(t, 1, ls2.Rows["discarded"])
	require.EqualValues(t, 1, ls2.Rows["pending"])
}

func TestBadConfigurationIsAClearError(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"worker", "--queues", "a:x"}, `weight "x"`},
		{[]string{"worker", "--concurrency", "0"}, "concurrency"},
		{[]string{"worker", "--shutdown-timeout", "-1s"}, "shutdown-timeout"},
		{[]string{"--redis-url", "foo://x", "worker"}, "unsupported scheme"},
		{[]string{"--log-level", "loud", "worker"}, "log-level"},
		{[]string{"--database-url", "postgres://127.0.0.1:1/x?connect_timeout=1", "status", "a", "b"}, "not answering"},
		{[]string{"worker", "--rate-limit", "mail=fast"}, "RATE/PERIOD"},
		{[]string{"web", "--trusted-proxy", "proxy.internal"}, "CIDR prefix"},
		{[]string{"web", "--allowed-host", "a b"}, "host"},
	} {
		root := cli.New(app())
		root.SetOut(&bytes.Buffer{})
		root.SetErr(&bytes.Buffer{})
		root.SetArgs(tc.args)
		err := root.ExecuteContext(context.Background())
		require.ErrorContains(t, err, tc.want, "%v", tc.args)
	}
}

// The compose file must only name subcommands the binary has.
func TestComposeNamesRealSubcommands(t *testing.T) {
	body, err := os.ReadFile("../../docker-compose.yml")
	require.NoError(t, err)
	root := cli.New(app())
	known := map[string]bool{}
	for _, c := range root.Commands() {
		known[c.Name()] = true
	}
	re := regexp.MustCompile(`command:\s*\[\s*"([a-z-]+)"`)
	matches := re.FindAllStringSubmatch(string(body), -1)
	require.NotEmpty(t, matches)
	for _, m := range matches {
		if m[1] == "redis-server" {
			continue
		}
		require.True(t, known[m[1]], "docker-compose.yml runs `keel %s`, which does not exist", m[1])
	}
}

// Every keel service of the compose file runs this binary, which declares
// the example's kinds: the dashboard above all, which shows payloads
// through the kinds' Summary (the stock keel binary, declaring none, would
// have to hide them).
func TestComposeRunsTheExamplesOwnBinary(t *testing.T) {
	body, err := os.ReadFile("../../docker-compose.yml")
	require.NoError(t, err)
	var f struct {
		Services map[string]struct {
			Image      string   `yaml:"image"`
			Entrypoint []string `yaml:"entrypoint"`
		} `yaml:"services"`
	}
	require.NoError(t, yaml.Unmarshal(body, &f))
	require.Contains(t, f.Services, "web")
	for name, s := range f.Services {
		if s.Image == "keel:local" {
			require.Equal(t, []string{"orders"}, s.Entrypoint, "service %s", name)
		}
	}
}
