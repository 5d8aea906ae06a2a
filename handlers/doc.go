// Package handlers is keel's example business code: an order system whose
// jobs are written in the idempotent-consumer style users should copy. Local
// writes commit together with the job's completion (idempotency.InTx);
// external calls are recorded steps with stable idempotency keys
// (idempotency.Step).
package handlers
