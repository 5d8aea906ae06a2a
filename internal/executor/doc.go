// Package executor runs a worker's deliveries against the ledger: the
// Guard middleware claims each job in completion-and-claim rounds with a
// lease and a run number, renews leases and the records of step calls in
// flight, gives up runs at their timeout or the worker's shutdown, lets a
// job whose earlier run crashed run alone (alone.go), records failures by
// their class and retires poison jobs. The run travels in the handler's
// context; InTx and Step (the idempotency package's API, implemented here)
// read it. Its statements are internal/ledger's; jobs are read and
// published through internal/jobstore.
package executor
