package main

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"regexp"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/cli"
	"github.com/keeljobs/keel/internal/testenv"
)

func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer l.Close()
	return l.Addr().String()
}

// The demo, run for a bounded time: orders are processed, no order is mailed
// twice despite the faults, bounced mails are dead letters with reasons, and
// the dashboard answers.
func TestDemoSmoke(t *testing.T) {
	if testing.Short() {
		t.Skip("runs the demo for half a minute")
	}
	t.Parallel()
	const demoSchema = "keel_test_demo"
	ctx := context.Background()
	cfg, err := testenv.PoolConfig(ctx, demoSchema) // a fresh schema; the demo migrates it
	require.NoError(t, err)
	redis := testenv.StartRedis(t)
	webAddr, apiAddr, mailAddr := freeAddr(t), freeAddr(t), freeAddr(t)

	root := cli.New(app())
	var out, errs testenv.SyncBuffer
	root.SetOut(&out)
	root.SetErr(&errs)
	root.SetArgs([]string{"--redis-url", "redis://" + redis.Addr() + "/0",
		"--database-url", testenv.URL(demoSchema), "--log-level", "warn",
		"demo", "--duration", "30s", "--rate", "15", "--web-addr", webAddr, "--api-addr", apiAddr, "--mail-addr", mailAddr,
		"--shutdown-timeout", "3s"})
	done := make(chan error, 1)
	go func() { done <- root.ExecuteContext(ctx) }()

	testenv.Eventually(t, 20*time.Second, func() bool {
		resp, err := http.Get("http://" + webAddr + "/healthz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	}, "the dashboard never answered")
	resp, err := http.Get("http://" + webAddr + "/monitoring/")
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode, "asynqmon's page should lead to the login form")
	require.Contains(t, resp.Request.URL.Path, "/login", "anonymous users must be sent to the login page")

	require.NoError(t, <-done)
	// The showcase configures itself as the docs say: its own workers
	// do not warn that its pool is too small for them.
	require.NotContains(t, errs.String(), "pool is smaller")
	text := out.String()
	require.Contains(t, text, "operator / keel-demo")
	m := regexp.MustCompile(`final: ledger, all runs: orders (\d+) \| jobs: (\d+) succeeded.* (\d+) dead.*\| mail service, this run: (\d+) calls, (\d+) mails, (\d+) orders mailed twice`).
		FindStringSubmatch(text)
	require.NotNil(t, m, "no final summary in:\n%s", text)
	orders, _ := strconv.Atoi(m[1])
	succeeded, _ := strconv.Atoi(m[2])
	mails, _ := strconv.Atoi(m[5])
	require.Greater(t, orders, 100, text)
	// Jobs and mails trail the orders by as much as the machine is busy: the
	// bounds say work flowed, not how fast.
	require.Greater(t, succeeded, orders, text)
	require.Greater(t, mails, orders/4, text)
	require.Equal(t, "0", m[6], "an order was mailed twice:\n%s", text)

	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	defer pool.Close()
	var dead, withReason int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*), count(*) FILTER (WHERE last_error <> '' AND error_class <> '')
		FROM keel_jobs WHERE status = 'dead'`).Scan(&dead, &withReason))
	require.Greater(t, dead, 0, "bounced mails should be dead letters")
	require.Equal(t, dead, withReason, "every dead job needs a reason and a class")
	fmt.Fprintln(testWriter{t}, m[0])
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) { w.t.Log(string(p)); return len(p), nil }
