// Package metrics exports keel's Prometheus metrics: Worker counts and times
// the jobs a worker runs (install its Middleware in the worker's chain), and
// Ledger reads queue depths, dead letters and the outbox backlog from Redis
// and the ledger at scrape time (the web server registers it).
//
// Every metric keel exports starts with "keel_"; the alert rules and the
// Grafana dashboard under deploy/ use only these names.
package metrics
