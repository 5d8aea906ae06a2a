-- The scheduler's memory: per cron entry, the newest tick handled (enqueued,
-- or dropped by the missed-tick policy). A scheduler starting after downtime
-- reads it to know which ticks it missed. It is only a hint: the ledger's
-- UNIQUE (kind, business_key) is what keeps a tick from running twice, so a
-- stale row costs a duplicate insert, never a duplicate job.
CREATE TABLE keel_schedule (
    entry      text PRIMARY KEY,
    last_tick  timestamptz NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now()
);
