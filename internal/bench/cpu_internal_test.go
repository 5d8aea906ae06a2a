package bench

import (
	"context"
	"os"
	"strconv"
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
	_, before, ok := serverCPU()
	require.True(t, ok)
	require.NoError(t, conn.Close(ctx))
	// Gone from /proc once its parent has reaped it.
	testenv.Eventually(t, 10*time.Second, func() bool {
		_, err := os.Stat("/proc/" + strconv.Itoa(pid))
		return os.IsNotExist(err)
	}, "backend %d did not exit", pid)
	_, after, ok := serverCPU()
	require.True(t, ok)
	// The backend spent well over 100 ms; other backends only add.
	require.GreaterOrEqual(t, after, before-20*time.Millisecond, "the exited backend's CPU time left the total")
}
