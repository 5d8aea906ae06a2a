// Package inspect is keel's operator API: what a person (or a program on
// their behalf) does to jobs, and the reads that go with it. The CLI, the
// dashboard and the dashboard's asynqmon all act through it.
//
// An Inspector replays, discards and cancels jobs, one by id or by kind and
// business key, or in bulk: by a list of ids, or by a Filter with the count
// the person confirmed (ErrCountChanged when the set has changed since).
// Each action says who took it (ErrActorRequired otherwise) and writes its
// row in the audit log in the transaction that changes the job. What an
// action refuses, and why, is decided in one place, the same for one job,
// for many and for a dry run (Check, DryRun):
//
//   - replay runs a dead job again with a fresh retry budget; it refuses a
//     job superseded by a newer one of its key, discarded or cancelled, one
//     whose completing InTx committed before its handler failed
//     (ErrEffectsCommitted), and one with a step in doubt that no Verify
//     settles (ErrStepsInDoubt: ResolveStep first). A job no longer dead
//     is left as it is.
//   - discard closes a dead job for good, with a note saying why; it
//     refuses a job not dead (a job running is cancelled instead).
//   - cancel closes a job not finished (pending, failed and waiting for its
//     retry, or running: its handler's context is cancelled, and nothing
//     that run does later commits); it refuses a job that has ended.
//
// Replay and discard remove asynq's copy of the job; cancel removes it or
// stops its handler. The ledger is the record: Redis is only tidied.
//
// The reads: Get, Lookup, Audit, Progress (what a job's handler last
// reported), Result and ResultByKey (what a succeeded job stored), Count
// and List by Filter, Counts of jobs by kind and status, and WaitDone,
// which waits for a job to end.
package inspect
