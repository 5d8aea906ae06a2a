-- keel:no-transaction
-- keel:additive
-- stray_until: until when a handler of this job that keel gave up (at its
-- timeout, or because the job was cancelled) may still be running and
-- acting; its worker renews it while the handler goes on and clears it when
-- the handler returns, and it runs out on its own if that worker dies. A
-- newer job of the same key (after a tasks.Unique window) does not start
-- while an older job's stray may still act: two runs of one key never
-- overlap. The partial index holds only such rows, so the claim's check
-- costs next to nothing. An older binary never sets it.
ALTER TABLE keel_jobs ADD COLUMN IF NOT EXISTS stray_until timestamptz;
CREATE INDEX CONCURRENTLY IF NOT EXISTS keel_jobs_strays ON keel_jobs (kind, business_key) WHERE stray_until IS NOT NULL;
