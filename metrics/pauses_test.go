package metrics_test

import (
	"context"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/inspect"
	"github.com/keeljobs/keel/internal/testenv"
	"github.com/keeljobs/keel/metrics"
)

// The ledger's pauses are metrics: the queues and kinds a person paused,
// and the jobs each paused kind holds.
func TestLedgerReportsPauses(t *testing.T) {
	pool, _ := testenv.PrivatePool(t)
	ctx := context.Background()
	insertJob(t, pool, "default", "export", "e1")
	insertJob(t, pool, "default", "export", "e2")
	insertJob(t, pool, "default", "report", "r1")
	ops, err := inspect.New(inspect.Config{Pool: pool})
	require.NoError(t, err)
	defer ops.Close()
	_, err = ops.PauseKind(ctx, "export", "ops", "the warehouse is closed")
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `INSERT INTO keel_pauses (queue, paused_by) VALUES ('low', 'ops')`)
	require.NoError(t, err)

	l := newLedger(t, metrics.LedgerConfig{Pool: pool})
	reg := prometheus.NewRegistry()
	reg.MustRegister(l)
	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP keel_kind_paused 1 for each kind the ledger holds paused (keel kind pause).
# TYPE keel_kind_paused gauge
keel_kind_paused{kind="export"} 1
# HELP keel_kind_paused_jobs Jobs held in the ledger because their kind is paused (or their queue, which Redis delivered them without), by kind: they run when the pause ends.
# TYPE keel_kind_paused_jobs gauge
keel_kind_paused_jobs{kind="export"} 2
# HELP keel_queue_paused_by_keel 1 for each queue the ledger holds paused (keel queue pause); a reconciler pass pauses it in Redis.
# TYPE keel_queue_paused_by_keel gauge
keel_queue_paused_by_keel{queue="low"} 1
`), "keel_kind_paused", "keel_kind_paused_jobs", "keel_queue_paused_by_keel"))

	_, err = ops.ResumeKind(ctx, "export", "ops", "open again")
	require.NoError(t, err)
	s := l.Read(ctx)
	require.NoError(t, s.PostgresErr)
	require.Empty(t, s.PausedKinds)
	require.Empty(t, s.PausedHeld)
}
