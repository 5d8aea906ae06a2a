// Package outbox keeps Redis in step with the ledger. The Relay publishes
// committed ledger rows that Redis does not have yet — written by
// tasks.Client.EnqueueTx, by Enqueue while Redis was down, or handed back by
// a worker — woken by Postgres NOTIFY, with polling as a fallback. The
// Reconciler republishes jobs Redis lost, hands the jobs of workers that
// are gone back to Redis within seconds (Rescue), and prunes finished jobs
// after their retention. Both run inside every worker by default and are
// safe to run in any number.
package outbox
