// Package server assembles a keel worker: an asynq.Server reading weighted
// queues, wrapped in keel's middleware chain (panic recovery, logging, the
// ledger guard, error classification), with an embedded relay and a graceful
// shutdown that hands unfinished jobs back to their queues.
package server
