package metrics_test

import (
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/metrics"
	"github.com/keeljobs/keel/outbox"
)

func onePruned() map[outbox.KindStatus]uint64 {
	return map[outbox.KindStatus]uint64{{Kind: "k", Status: "succeeded"}: 1}
}

func oneToDrop() map[string]int { return map[string]int{"k": 1} }

// The reconciler's prune counts reach Prometheus by kind and status, and
// the dead letters to be dropped by kind, as the scrape finds them.
func TestPrunedJobsByKindAndStatus(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	pruned := map[outbox.KindStatus]uint64{{Kind: "a", Status: "succeeded"}: 7, {Kind: "a", Status: "dead"}: 2}
	toDrop := map[string]int{"a": 3}
	require.NoError(t, metrics.RegisterOutbox(reg, metrics.OutboxOptions{
		PrunedByKind:      func() map[outbox.KindStatus]uint64 { return pruned },
		DeadLettersToDrop: func() map[string]int { return toDrop },
	}))
	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP keel_dead_letters_to_drop Seen dead letters past their kind's bounds, alerted and dropped once the notice (DeadDropNotice, 24h) has run, by kind.
# TYPE keel_dead_letters_to_drop gauge
keel_dead_letters_to_drop{kind="a"} 3
# HELP keel_pruned_jobs_total Jobs pruned after their kind's retention, by kind and status; dead letters dropped by their kind's bounds count as status dead.
# TYPE keel_pruned_jobs_total counter
keel_pruned_jobs_total{kind="a",status="dead"} 2
keel_pruned_jobs_total{kind="a",status="succeeded"} 7
`), "keel_pruned_jobs_total", "keel_dead_letters_to_drop"))
	// The alert's gauge goes once nothing is left to drop.
	toDrop = map[string]int{}
	n, err := testutil.GatherAndCount(reg, "keel_dead_letters_to_drop")
	require.NoError(t, err)
	require.Zero(t, n)
}
