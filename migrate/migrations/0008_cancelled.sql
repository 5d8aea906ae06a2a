-- keel:no-transaction
-- keel:additive
-- A person (or a program) may cancel a job that has not finished: the new
-- terminal status 'cancelled'. Additive: a worker one version behind never
-- writes it, and takes a delivery of a cancelled job for a busy lease until
-- asynq gives the task up; nothing it does changes the row.
--
-- The status check is swapped for a wider one NOT VALID (no scan under the
-- exclusive lock) and validated after, which lets writers go on; both
-- statements may run again.
ALTER TABLE keel_jobs DROP CONSTRAINT IF EXISTS keel_jobs_status_check,
    ADD CONSTRAINT keel_jobs_status_check
    CHECK (status IN ('pending', 'running', 'succeeded', 'failed', 'dead', 'discarded', 'cancelled')) NOT VALID;
ALTER TABLE keel_jobs VALIDATE CONSTRAINT keel_jobs_status_check;

-- Pruning walks every finished job oldest first, cancelled ones too. The
-- older index's predicate implies this one's, so its queries use this one.
CREATE INDEX CONCURRENTLY IF NOT EXISTS keel_jobs_finished ON keel_jobs (finished_at) WHERE status IN ('succeeded', 'discarded', 'cancelled');
DROP INDEX CONCURRENTLY IF EXISTS keel_jobs_prunable;
