// Package idempotency is keel's ledger: the Postgres table that remembers
// every business action (one row per kind and business key), its embedded
// migrations, and the asynq middleware (Guard) that makes deliveries of a
// job run its handler at most once at a time and never again after it
// finished.
//
// Inside a handler run by the Guard:
//
//   - InTx commits the handler's local writes in the same transaction as the
//     job's "succeeded" mark, and refuses if this worker lost the job's lease;
//   - Step records an external call under a stable idempotency key (job id
//     and step name): a finished step is skipped on retry, and a step whose
//     call may have happened (an error not known to come before sending, or
//     a process that died mid-call) is verified (Verify) or parked for a
//     person — never repeated blindly. StepHTTP and DoHTTP send one HTTP
//     request and tell a call that never left from one in doubt; NotSent
//     marks what other clients know. Steps come before the completing InTx.
//
// The Store reads jobs (Get, Lookup, Steps). What a person does to jobs
// (replay, discard, cancel, step resolution) is the inspect package's.
//
// With an OpenTelemetry tracer provider (GuardConfig.TracerProvider, or the
// global one) each run is a keel.handle span continuing the trace its job
// was enqueued in, with keel.claim, keel.step and keel.intx spans under it.
package idempotency
