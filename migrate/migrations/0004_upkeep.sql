-- keel:no-transaction
-- keel:additive
-- Indexes are built CONCURRENTLY so that upgrading a large ledger does not
-- block its writers; every statement may run again after a failed attempt.

-- The reconciler walks only jobs that should still run.
CREATE INDEX CONCURRENTLY IF NOT EXISTS keel_jobs_open ON keel_jobs (id) WHERE status IN ('pending', 'running', 'failed');
-- Pruning walks finished jobs oldest first.
CREATE INDEX CONCURRENTLY IF NOT EXISTS keel_jobs_prunable ON keel_jobs (finished_at) WHERE status IN ('succeeded', 'discarded');

-- What pruning removed, so operators can see the prune rate.
CREATE TABLE IF NOT EXISTS keel_prune_log (
    at   timestamptz NOT NULL DEFAULT now(),
    rows integer NOT NULL
);
CREATE INDEX CONCURRENTLY IF NOT EXISTS keel_prune_log_at ON keel_prune_log (at);
