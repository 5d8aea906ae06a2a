// Package tasks declares job kinds with typed payloads and business keys, and
// enqueues them: durably into the Postgres ledger first (directly, or inside
// the caller's transaction with EnqueueTx; many at once with EnqueueMany and
// EnqueueManyTx), then into Redis for asynq. Concurrent Enqueue calls share
// one insert and one commit. It also holds the Mux that routes each kind to
// its handler on a worker. Result and ResultByKey read what a succeeded
// job's handler stored (idempotency.SetResult); ResultAs decodes it.
//
// Define registers a kind nowhere: a program lists its own in a Kinds
// (NewKinds) and gives that set to what needs kinds by name (the worker's
// dead-letter summaries, the dashboard, the scheduler, the CLI).
//
// An enqueue made under an OpenTelemetry span stores that span's trace
// context with its jobs, so their publish and runs continue the trace; with
// a tracer provider (ClientConfig.TracerProvider, or the global one) each
// call is a keel.enqueue span.
package tasks
