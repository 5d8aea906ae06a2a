-- keel:additive
-- The relay's work list: one narrow row per due job EnqueueTx or
-- EnqueueManyTx wrote (queued_at: its transaction's start), deleted by the
-- relay that publishes it. Claiming through keel_jobs.published_at instead
-- rewrote the whole job row and an entry in each of its indexes
-- (published_at is in keel_jobs_unpublished's predicate, so the update is
-- never HOT), and left a dead entry in keel_jobs_unpublished that every
-- later claim stepped over until the big table was vacuumed. The job row
-- carries published_at from the insert. Every row is deleted soon after it
-- is written, so this table is vacuumed after a fixed number of dead rows
-- rather than a fraction of its size. No foreign key: the relay drops a row
-- whose job is gone.
CREATE TABLE IF NOT EXISTS keel_outbox (
    job_id    text PRIMARY KEY,
    queued_at timestamptz NOT NULL DEFAULT now()
) WITH (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 10000);
CREATE INDEX IF NOT EXISTS keel_outbox_queued_at ON keel_outbox (queued_at);
