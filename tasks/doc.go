// Package tasks declares job kinds with typed payloads and business keys, and
// enqueues them: durably into the Postgres ledger first (directly, or inside
// the caller's transaction with EnqueueTx; many at once with EnqueueMany and
// EnqueueManyTx), then into Redis for asynq. Concurrent Enqueue calls share
// one insert and one commit. It also holds the Mux that routes each kind to
// its handler on a worker.
package tasks
