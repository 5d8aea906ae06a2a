// Package jobstore reads and writes keel's jobs for every part of keel
// that is not a handler's run: inserts (one, many, superseding a key's
// old job), look-ups, batches, the relay's claims of unpublished jobs, and
// the Publisher, which puts them into asynq's queues many per round trip
// (the layout is internal/asynqwire's). Its statements are
// internal/ledger's.
package jobstore
