package metrics_test

import (
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/metrics"
)

func TestNewWorkerRefusesAConfigThatCannotWork(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		mod  func(*metrics.WorkerConfig)
		err  []string
	}{
		{"no Registerer", func(c *metrics.WorkerConfig) { c.Registerer = nil }, []string{"WorkerConfig.Registerer is required"}},
		{"a kind without a name", func(c *metrics.WorkerConfig) { c.Kinds = []metrics.Kind{{Queue: "critical"}} },
			[]string{"WorkerConfig.Kinds[0]", "no name"}},
		// Prometheus would panic on the first observation, not here.
		{"buckets out of order", func(c *metrics.WorkerConfig) { c.Buckets = []float64{1, 0.5} }, []string{"WorkerConfig.Buckets", "increasing"}},
		{"a bucket twice", func(c *metrics.WorkerConfig) { c.Buckets = []float64{1, 1} }, []string{"WorkerConfig.Buckets"}},
		{"everything at once", func(c *metrics.WorkerConfig) {
			*c = metrics.WorkerConfig{Kinds: []metrics.Kind{{}}, Buckets: []float64{2, 1}}
		}, []string{"Registerer", "Kinds[0]", "Buckets"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			reg := prometheus.NewRegistry()
			c := metrics.WorkerConfig{Registerer: reg}
			tc.mod(&c)
			for _, want := range tc.err {
				require.ErrorContains(t, c.Validate(), want)
			}
			var w *metrics.Worker
			var err error
			require.NotPanics(t, func() { w, err = metrics.NewWorker(c) })
			for _, want := range tc.err {
				require.ErrorContains(t, err, want)
			}
			require.Nil(t, w)
			got, gerr := reg.Gather()
			require.NoError(t, gerr)
			require.Empty(t, got, "a refused config registers nothing")
		})
	}
	require.NoError(t, metrics.WorkerConfig{Registerer: prometheus.NewRegistry()}.Validate())
}

func TestNewLedgerRefusesANegativeTimeout(t *testing.T) {
	t.Parallel()
	c := metrics.LedgerConfig{Timeout: -time.Second}
	require.ErrorContains(t, c.Validate(), "LedgerConfig.Timeout")
	l, err := metrics.NewLedger(c)
	require.ErrorContains(t, err, "LedgerConfig.Timeout must not be negative")
	require.Nil(t, l)

	c = metrics.LedgerConfig{ScheduleGrace: -time.Minute}
	require.ErrorContains(t, c.Validate(), "LedgerConfig.ScheduleGrace must not be negative")

	// Neither source is required: what has none is left out.
	l, err = metrics.NewLedger(metrics.LedgerConfig{})
	require.NoError(t, err)
	require.NotNil(t, l)
}

// newLedger is NewLedger for a config the test knows to be valid.
func newLedger(t testing.TB, c metrics.LedgerConfig) *metrics.Ledger {
	t.Helper()
	l, err := metrics.NewLedger(c)
	require.NoError(t, err)
	return l
}
