-- keel:no-transaction
-- keel:additive
-- The rescuer looks up running jobs whose lease expired.
CREATE INDEX CONCURRENTLY IF NOT EXISTS keel_jobs_running_lease ON keel_jobs (lease_until) WHERE status = 'running';
