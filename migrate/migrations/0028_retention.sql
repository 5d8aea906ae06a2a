-- keel:no-transaction
-- keel:additive
-- Retention per kind and status. A row is a policy: how long a kind's jobs
-- of one status are kept (keep_ms; NULL: for ever), and for dead letters
-- how many are kept (max_count; NULL: no bound). source says who set it:
-- 'person' (keel retention set, audited) wins over 'code' (a kind's
-- tasks.Keep, recorded by its workers); a kind and status with neither
-- keeps the reconciler's Retention, and dead letters are kept for ever.
-- An older binary never reads it and prunes as before.
CREATE TABLE IF NOT EXISTS keel_retention (
    kind      text NOT NULL,
    status    text NOT NULL CHECK (status IN ('succeeded', 'discarded', 'cancelled', 'dead')),
    source    text NOT NULL CHECK (source IN ('person', 'code')),
    keep_ms   bigint CHECK (keep_ms > 0),
    max_count bigint CHECK (max_count IS NULL OR (max_count > 0 AND status = 'dead')),
    set_by    text NOT NULL,
    set_at    timestamptz NOT NULL DEFAULT now(),
    note      text NOT NULL DEFAULT '',
    PRIMARY KEY (kind, status, source)
);
-- A dead letter is seen once a person was shown it after it died (seen_at
-- not before finished_at): only seen ones are ever dropped. drop_noticed_at
-- is when a reconciler first found it past its kind's bound and alerted;
-- it is dropped a notice period later, if it is still dead, seen and past
-- the bound. A replay and a new death move finished_at past both marks.
ALTER TABLE keel_jobs ADD COLUMN IF NOT EXISTS seen_at timestamptz;
ALTER TABLE keel_jobs ADD COLUMN IF NOT EXISTS seen_by text;
ALTER TABLE keel_jobs ADD COLUMN IF NOT EXISTS drop_noticed_at timestamptz;
-- Pruning goes kind by kind and status by status, oldest first. The index
-- replaces keel_jobs_finished (0008): two would cost every finished job a
-- second index entry. An older binary's prune, by finished_at alone, reads
-- the table instead until it is replaced.
CREATE INDEX CONCURRENTLY IF NOT EXISTS keel_jobs_finished_kind ON keel_jobs (kind, status, finished_at)
    WHERE status IN ('succeeded', 'discarded', 'cancelled');
DROP INDEX CONCURRENTLY IF EXISTS keel_jobs_finished;
-- The dead letters due to be dropped, counted per kind for the alert.
CREATE INDEX CONCURRENTLY IF NOT EXISTS keel_jobs_drop_noticed ON keel_jobs (kind)
    WHERE status = 'dead' AND drop_noticed_at IS NOT NULL;
