package metrics_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/metrics"
	"github.com/keeljobs/keel/retry"
)

func TestWorkerCountsAttemptsByOutcome(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	var skipped uint64 = 7
	w, err := metrics.NewWorker(reg, metrics.WorkerOptions{DuplicatesSkipped: func() uint64 { return skipped }})
	require.NoError(t, err)

	outcomes := []error{
		nil,
		nil,
		retry.Permanent(errors.New("bad input")),
		retry.Transient(errors.New("connection reset")),
		errors.New("who knows"),
		retry.Wait(time.Second, errors.New("rate limited")),
	}
	for _, out := range outcomes {
		h := w.Middleware(asynq.HandlerFunc(func(context.Context, *asynq.Task) error { return out }))
		err := h.ProcessTask(context.Background(), asynq.NewTask("order:send_receipt", nil))
		require.ErrorIs(t, err, out, "the middleware passes the handler's error on unchanged")
	}
	w.OnDead(context.Background(), idempotency.DeadEvent{Kind: "order:send_receipt", Queue: "critical", Class: "permanent"})

	// Outside a worker there is no queue name in the context: the label is empty.
	require.Equal(t, 5.0, gatherValue(t, reg, "keel_jobs_processed_total", map[string]string{"kind": "order:send_receipt", "queue": ""}),
		"successes and failures count as processed; a wait does not")
	for class, want := range map[string]float64{"permanent": 1, "transient": 1, "unknown": 1} {
		require.Equal(t, want, gatherValue(t, reg, "keel_jobs_failed_total", map[string]string{"class": class}), class)
	}
	require.Equal(t, 1.0, gatherValue(t, reg, "keel_jobs_postponed_total", nil))
	require.Equal(t, 1.0, gatherValue(t, reg, "keel_jobs_dead_total", map[string]string{"queue": "critical", "class": "permanent"}))
	require.Equal(t, 7.0, gatherValue(t, reg, "keel_duplicate_deliveries_skipped_total", nil))
	require.Equal(t, 6, histogramCount(t, reg, "keel_job_duration_seconds"))
}

func TestWorkerRefusesDoubleRegistration(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	_, err := metrics.NewWorker(reg, metrics.WorkerOptions{})
	require.NoError(t, err)
	_, err = metrics.NewWorker(reg, metrics.WorkerOptions{})
	require.Error(t, err)
}

// gatherValue sums the values of the series of family name whose labels
// include want.
func gatherValue(t *testing.T, g prometheus.Gatherer, name string, want map[string]string) float64 {
	t.Helper()
	mfs, err := g.Gather()
	require.NoError(t, err)
	var sum float64
	found := false
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	series:
		for _, m := range mf.GetMetric() {
			got := map[string]string{}
			for _, lp := range m.GetLabel() {
				got[lp.GetName()] = lp.GetValue()
			}
			for k, v := range want {
				if got[k] != v {
					continue series
				}
			}
			found = true
			switch {
			case m.Counter != nil:
				sum += m.GetCounter().GetValue()
			case m.Gauge != nil:
				sum += m.GetGauge().GetValue()
			}
		}
	}
	require.True(t, found, "no series of %s with labels %v", name, want)
	return sum
}

func histogramCount(t *testing.T, g prometheus.Gatherer, name string) int {
	t.Helper()
	mfs, err := g.Gather()
	require.NoError(t, err)
	n := 0
	for _, mf := range mfs {
		if mf.GetName() == name {
			for _, m := range mf.GetMetric() {
				n += int(m.GetHistogram().GetSampleCount())
			}
		}
	}
	return n
}

func TestWorkerExportsGivenUpRuns(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	stats := idempotency.GuardStats{Overran: 2, Interrupted: 3, Crashed: 1}
	_, err := metrics.NewWorker(reg, metrics.WorkerOptions{Guard: func() idempotency.GuardStats { return stats }})
	require.NoError(t, err)
	require.Equal(t, 2.0, gatherValue(t, reg, "keel_handlers_overran_total", nil))
	require.Equal(t, 3.0, gatherValue(t, reg, "keel_runs_interrupted_total", nil))
	require.Equal(t, 1.0, gatherValue(t, reg, "keel_poison_jobs_retired_total", nil))
}
