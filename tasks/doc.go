// Package tasks declares job kinds with typed payloads and business keys, and
// enqueues them: durably into the Postgres ledger first (directly, or inside
// the caller's transaction with EnqueueTx), then into Redis for asynq. It also
// holds the Mux that routes each kind to its handler on a worker.
package tasks
