-- keel:additive
-- What the guard needs to retire every job: runs that ended without an
-- outcome (a crash), the last worker that held it, the time it spent waiting
-- (rate limits, busy leases) and that time's ceiling. All additive: a worker
-- one version behind still reads and writes the table.
ALTER TABLE keel_jobs
    ADD COLUMN crashes     integer NOT NULL DEFAULT 0,
    ADD COLUMN last_holder text,
    ADD COLUMN waited_ms   bigint  NOT NULL DEFAULT 0,
    ADD COLUMN max_wait_ms bigint  NOT NULL DEFAULT 0;
