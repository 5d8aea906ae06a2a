package metrics_test

import (
	"log"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/keeljobs/keel/metrics"
	"github.com/keeljobs/keel/server"
)

// A worker's job metrics: its middleware counts every attempt, its hooks
// every death, expiry and cancel; the kinds it declares are exported at 0
// from the start, so alerts see the first death.
func ExampleNewWorker() {
	reg := prometheus.NewRegistry()
	wm, err := metrics.NewWorker(metrics.WorkerConfig{Registerer: reg,
		Kinds: []metrics.Kind{{Name: "order:send_receipt", Queue: "critical"}}})
	if err != nil {
		log.Fatal(err)
	}
	var cfg server.Config
	cfg.Middleware = append(cfg.Middleware, wm.Middleware)
	cfg.Guard.OnDead = wm.OnDead
	cfg.Guard.OnExpired = wm.OnExpired
	cfg.Guard.OnCancelled = wm.OnCancelled
	// … server.New(cfg, mux), and serve reg with promhttp.HandlerFor.
}
