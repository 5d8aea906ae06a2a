// Package handlers is the example business code users copy: an order system
// (API, job handlers, a simulated mail service) that examples/orders runs,
// not a part of keel's API to import. Its jobs are written in the
// idempotent-consumer style: local writes commit together with the job's
// completion (idempotency.InTx); external calls are recorded steps with
// stable idempotency keys (idempotency.Step). It imports only keel's public
// packages (tasks, idempotency, retry), so that a copy builds outside keel.
package handlers
