package bench

import (
	"context"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/internal/testenv"
)

// A backend that does its work and exits keeps its CPU time in the
// Postgres total: a benchmark closes its pools before it reads the meter,
// and the time must not turn into "other processes" instead.
func TestServerCPUKeepsExitedBackends(t *testing.T) {
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, testenv.DatabaseURL())
	require.NoError(t, err)
	var pid int
	require.NoError(t, conn.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid))
	if _, err := os.Stat("/proc/" + strconv.Itoa(pid)); err != nil {
		conn.Close(ctx)
		t.Skip("Postgres does not run on this host:", err)
	}
	_, err = conn.Exec(ctx, "SELECT count(*) FROM generate_series(1, 5000000)")
	require.NoError(t, err)
	// This server's processes only: a private Postgres another test stops
	// meanwhile takes its time out of the host's total.
	stat, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	require.NoError(t, err)
	fields := strings.Fields(string(stat[strings.LastIndexByte(string(stat), ')')+1:]))
	postmaster, err := strconv.Atoi(fields[1])
	require.NoError(t, err)
	ours := func(pid, ppid int) bool { return pid == postmaster || ppid == postmaster }
	_, before, ok := serverCPUOf(ours)
	require.True(t, ok)
	require.NoError(t, conn.Close(ctx))
	// Gone from /proc once its parent has reaped it.
	testenv.Eventually(t, 10*time.Second, func() bool {
		_, err := os.Stat("/proc/" + strconv.Itoa(pid))
		return os.IsNotExist(err)
	}, "backend %d did not exit", pid)
	_, after, ok := serverCPUOf(ours)
	require.True(t, ok)
	// The backend spent well over 100 ms; other backends only add.
	require.GreaterOrEqual(t, after, before-20*time.Millisecond, "the exited backend's CPU time left the total")
}
