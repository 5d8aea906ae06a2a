-- The reconciler walks only jobs that should still run.
CREATE INDEX keel_jobs_open ON keel_jobs (id) WHERE status IN ('pending', 'running', 'failed');
-- Pruning walks finished jobs oldest first.
CREATE INDEX keel_jobs_prunable ON keel_jobs (finished_at) WHERE status IN ('succeeded', 'discarded');

-- What pruning removed, so operators can see the prune rate.
CREATE TABLE keel_prune_log (
    at   timestamptz NOT NULL DEFAULT now(),
    rows integer NOT NULL
);
CREATE INDEX keel_prune_log_at ON keel_prune_log (at);
