// Package idempotency is the API a keel handler uses to run its side
// effects once: the job a handler runs is claimed in keel's Postgres
// ledger (one row per kind and business key) by the worker's guard, and
// inside that run:
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
// Progress reports how far a run has got (written at most once a second
// per run, only while the run holds its job); SetResult stores a result
// that commits with the job's success and never without it, and ResultOf
// reads another job's.
//
// JobID and Attempt say which job and run a handler is; Job, Status,
// StepRecord, JobProgress and JobResult are the ledger's rows; the errors
// are those a handler sees.
// Reading jobs and acting on them (replay, discard, cancel, step
// resolution) is the inspect package's; the guard itself is configured
// through server.Config.Guard.
//
// With an OpenTelemetry tracer provider (server.GuardConfig.TracerProvider,
// or the global one) each run is a keel.handle span continuing the trace
// its job was enqueued in, with keel.claim, keel.step and keel.intx spans
// under it.
package idempotency
