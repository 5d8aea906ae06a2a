-- keel:no-transaction
-- keel:additive
-- alert_owed: the job died and its worker's death hook (log, counters,
-- alerts) has not yet returned. Set by the statement that records the
-- death, cleared once the hook ran; a worker killed in between leaves it
-- set, and a reconciler runs the hook for it. The partial index holds only
-- such rows. An older worker never sets it: its deaths are alerted by
-- itself or, if it is killed first, not at all, as before.
ALTER TABLE keel_jobs ADD COLUMN IF NOT EXISTS alert_owed boolean NOT NULL DEFAULT false;
CREATE INDEX CONCURRENTLY IF NOT EXISTS keel_jobs_alert_owed ON keel_jobs (updated_at) WHERE alert_owed AND status = 'dead';
