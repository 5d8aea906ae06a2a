package metrics_test

import (
	"context"
	"testing"

	"github.com/hibiken/asynq"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/keeljobs/keel/metrics"
)

// BenchmarkWorkerMiddleware is the metrics middleware's own cost per
// successful attempt of a no-op handler:
//
//	go test -run XXX -bench WorkerMiddleware -benchmem ./metrics/
func BenchmarkWorkerMiddleware(b *testing.B) {
	w, err := metrics.NewWorker(metrics.WorkerConfig{Registerer: prometheus.NewRegistry(),
		Kinds: []metrics.Kind{{Name: "bench:noop"}}})
	if err != nil {
		b.Fatal(err)
	}
	h := w.Middleware(asynq.HandlerFunc(func(context.Context, *asynq.Task) error { return nil }))
	t := asynq.NewTask("bench:noop", nil)
	ctx := context.Background()
	b.ReportAllocs()
	for b.Loop() {
		if err := h.ProcessTask(ctx, t); err != nil {
			b.Fatal(err)
		}
	}
}
