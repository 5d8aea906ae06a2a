package metrics_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/prometheus/client_golang/prometheus/testutil/promlint"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/metrics"
	"github.com/keeljobs/keel/retry"
	"github.com/keeljobs/keel/server"
)

func TestWorkerCountsAttemptsByOutcome(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	var skipped uint64 = 7
	w, err := metrics.NewWorker(metrics.WorkerConfig{Registerer: reg, DuplicatesSkipped: func() uint64 { return skipped }})
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
	// A run stopped by a cancel is not a failure.
	h := w.Middleware(asynq.HandlerFunc(func(context.Context, *asynq.Task) error {
		return fmt.Errorf("InTx: %w", idempotency.ErrCancelled)
	}))
	require.ErrorIs(t, h.ProcessTask(context.Background(), asynq.NewTask("order:send_receipt", nil)), idempotency.ErrCancelled)
	w.OnCancelled(context.Background(), idempotency.CancelEvent{Kind: "order:send_receipt", Queue: "critical"})

	// Outside a worker there is no queue name in the context: the label is empty.
	require.Equal(t, 5.0, gatherValue(t, reg, "keel_jobs_processed_total", map[string]string{"kind": "order:send_receipt", "queue": ""}),
		"successes and failures count as processed; a wait does not")
	require.Equal(t, 2.0, gatherValue(t, reg, "keel_jobs_succeeded_total", map[string]string{"kind": "order:send_receipt", "queue": ""}))
	for class, want := range map[string]float64{"permanent": 1, "transient": 1, "unknown": 1} {
		require.Equal(t, want, gatherValue(t, reg, "keel_jobs_failed_total", map[string]string{"class": class}), class)
	}
	require.Equal(t, 1.0, gatherValue(t, reg, "keel_jobs_postponed_total", nil))
	require.Equal(t, 1.0, gatherValue(t, reg, "keel_jobs_dead_total", map[string]string{"queue": "critical", "class": "permanent"}))
	require.Equal(t, 7.0, gatherValue(t, reg, "keel_duplicate_deliveries_skipped_total", nil))
	require.Equal(t, 1.0, gatherValue(t, reg, "keel_jobs_cancelled_total", map[string]string{"kind": "order:send_receipt"}))
	require.Equal(t, 7, histogramCount(t, reg, "keel_job_duration_seconds"))
}

func TestWorkerRefusesDoubleRegistration(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	_, err := metrics.NewWorker(metrics.WorkerConfig{Registerer: reg})
	require.NoError(t, err)
	_, err = metrics.NewWorker(metrics.WorkerConfig{Registerer: reg})
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
	stats := server.GuardStats{Overran: 2, Interrupted: 3, Crashed: 1, HungHandlers: 4}
	_, err := metrics.NewWorker(metrics.WorkerConfig{Registerer: reg, Guard: func() server.GuardStats { return stats }})
	require.NoError(t, err)
	require.Equal(t, 2.0, gatherValue(t, reg, "keel_handlers_overran_total", nil))
	require.Equal(t, 3.0, gatherValue(t, reg, "keel_runs_interrupted_total", nil))
	require.Equal(t, 1.0, gatherValue(t, reg, "keel_poison_jobs_retired_total", nil))
	require.Equal(t, 4.0, gatherValue(t, reg, "keel_handlers_hung", nil))
}

var declared = []metrics.Kind{
	{Name: "order:send_receipt", Queue: "critical"},
	{Name: "report:daily", Queue: "reports"},
	{Name: "analytics:sync"}, // the default queue
}

// series returns the label sets of the series of family name, each as
// kind/queue[/class], with their values.
func series(t *testing.T, g prometheus.Gatherer, name string) map[string]float64 {
	t.Helper()
	mfs, err := g.Gather()
	require.NoError(t, err)
	out := map[string]float64{}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			labels := map[string]string{}
			for _, lp := range m.GetLabel() {
				labels[lp.GetName()] = lp.GetValue()
			}
			key := labels["kind"] + "/" + labels["queue"]
			if c, ok := labels["class"]; ok {
				key += "/" + c
			}
			out[key] = m.GetCounter().GetValue()
		}
	}
	return out
}

func TestWorkerExportsDeclaredKindsBeforeAnyJobRan(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	w, err := metrics.NewWorker(metrics.WorkerConfig{Registerer: reg, Kinds: declared})
	require.NoError(t, err)

	queueOf := func(k metrics.Kind) string {
		if k.Queue == "" {
			return "default"
		}
		return k.Queue
	}
	want := map[string]float64{}
	for _, k := range declared {
		for _, c := range retry.StoredClasses() {
			want[k.Name+"/"+queueOf(k)+"/"+string(c)] = 0
		}
	}
	require.Len(t, want, len(declared)*len(retry.StoredClasses()))
	require.Equal(t, want, series(t, reg, "keel_jobs_dead_total"), "a dead series at 0 for every declared kind and class")
	require.Equal(t, want, series(t, reg, "keel_jobs_failed_total"))
	perKind := map[string]float64{}
	for _, k := range declared {
		perKind[k.Name+"/"+queueOf(k)] = 0
	}
	for _, name := range []string{"keel_jobs_processed_total", "keel_jobs_succeeded_total", "keel_jobs_postponed_total"} {
		require.Equal(t, perKind, series(t, reg, name), name)
	}
	cancelled := map[string]float64{}
	for _, k := range declared {
		cancelled[k.Name+"/"] = 0 // series joins the labels, kind alone here
	}
	require.Equal(t, cancelled, series(t, reg, "keel_jobs_cancelled_total"))

	// The first death moves its series from 0 to 1: increase() sees it.
	w.OnDead(context.Background(), idempotency.DeadEvent{Kind: "report:daily", Queue: "reports", Class: string(retry.ClassCrashed)})
	want["report:daily/reports/crashed"] = 1
	require.Equal(t, want, series(t, reg, "keel_jobs_dead_total"))
}

// TestMetricsPassPromlint runs the checks of `promtool check metrics`
// (promlint, which promtool calls) on what a worker and a web server expose
// before any job ran.
func TestMetricsPassPromlint(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	zero := func() uint64 { return 0 }
	_, err := metrics.NewWorker(metrics.WorkerConfig{Registerer: reg, Kinds: declared, DuplicatesSkipped: zero,
		Guard: func() server.GuardStats { return server.GuardStats{} }})
	require.NoError(t, err)
	require.NoError(t, metrics.RegisterOutbox(reg, metrics.OutboxOptions{Published: zero, Republished: zero,
		LeasesReleased: zero, Pruned: zero}))
	reg.MustRegister(newLedger(t, metrics.LedgerConfig{}))

	rec := httptest.NewRecorder()
	req := httptest.NewRequest(http.MethodGet, "/metrics", nil)
	req.Header.Set("Accept", "text/plain")
	promhttp.HandlerFor(reg, promhttp.HandlerOpts{}).ServeHTTP(rec, req)
	require.Equal(t, http.StatusOK, rec.Code)
	body := rec.Body.String()
	require.Contains(t, body, `keel_jobs_dead_total{class="permanent",kind="order:send_receipt",queue="critical"} 0`)

	problems, err := promlint.New(strings.NewReader(body)).Lint()
	require.NoError(t, err)
	require.Empty(t, problems)

	// The linter does look: a counter without _total is a problem.
	bad := prometheus.NewRegistry()
	bad.MustRegister(prometheus.NewCounter(prometheus.CounterOpts{Name: "keel_jobs_dead", Help: "x"}))
	mfs, err := bad.Gather()
	require.NoError(t, err)
	problems, err = promlint.NewWithMetricFamilies(mfs).Lint()
	require.NoError(t, err)
	require.NotEmpty(t, problems)
}
