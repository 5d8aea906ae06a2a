package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// demoScript runs scripts/demo with env, its service tools and go replaced
// by stubs that record their calls (services answer as if up), and returns
// the calls.
func demoScript(t *testing.T, env ...string) []string {
	t.Helper()
	dir := t.TempDir()
	log := filepath.Join(dir, "calls")
	stub := "#!/bin/sh\necho \"${0##*/} $*\" >>\"$KEEL_STUB_LOG\"\n" +
		"case ${0##*/} in redis-cli) echo PONG ;; psql) echo 1 ;; esac\n"
	for _, name := range []string{"go", "redis-cli", "redis-server", "pg_isready", "psql", "createdb",
		"pg_ctlcluster", "pg_createcluster", "apt-get", "runuser"} {
		require.NoError(t, os.WriteFile(filepath.Join(dir, name), []byte(stub), 0o755))
	}
	cmd := exec.Command("bash", "../../scripts/demo", "--duration", "1s")
	cmd.Env = append([]string{"PATH=" + dir + ":" + os.Getenv("PATH"), "HOME=" + os.Getenv("HOME"), "KEEL_STUB_LOG=" + log}, env...)
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "%s", out)
	calls, err := os.ReadFile(log)
	require.NoError(t, err, "%s", out)
	return strings.Split(strings.TrimSpace(string(calls)), "\n")
}

// With REDIS_URL and DATABASE_URL the services are the user's: the demo
// neither checks nor starts local ones, nor creates keel_test, and runs
// against the URLs (the demo reads them). Without, it sees to the local ones.
func TestDemoScriptLeavesServicesToTheURLs(t *testing.T) {
	run := "go run ./examples/orders --log-level warn demo --duration 1s"
	require.Equal(t, []string{run}, demoScript(t, "REDIS_URL=redis://cache:6379/0", "DATABASE_URL=postgres://app@db/keel"))

	calls := demoScript(t, "REDIS_URL=redis://cache:6379/0")
	require.Equal(t, run, calls[len(calls)-1])
	require.NotContains(t, strings.Join(calls, "\n"), "redis-cli", "REDIS_URL names the Redis")
	require.Contains(t, strings.Join(calls, "\n"), "pg_isready", "the local Postgres is the demo's")

	calls = demoScript(t)
	require.Equal(t, run, calls[len(calls)-1])
	require.Contains(t, calls, "redis-cli -h 127.0.0.1 -p 6379 ping")
	require.Contains(t, calls, "pg_isready -q -h 127.0.0.1 -p 5432")
}
