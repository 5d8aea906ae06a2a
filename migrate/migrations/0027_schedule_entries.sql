-- keel:additive
-- Cron entries a person adds, changes and removes at run time (keel schedule,
-- the dashboard, inspect.AddSchedule), beside those of a scheduler's file or
-- code. Every running scheduler reads them every couple of seconds.
CREATE TABLE IF NOT EXISTS keel_schedule_entries (
    name       text PRIMARY KEY,
    spec       text NOT NULL,
    timezone   text NOT NULL DEFAULT '',
    kind       text NOT NULL,
    payload    jsonb NOT NULL DEFAULT '{}',
    queue      text NOT NULL DEFAULT '',
    max_retry  integer,
    timeout_ms bigint NOT NULL DEFAULT 0,
    created_at timestamptz NOT NULL DEFAULT now(),
    created_by text NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now(),
    updated_by text NOT NULL
);
-- Paused entries, whatever defines them (file, code or run time): no
-- scheduler enqueues their ticks while the row exists.
CREATE TABLE IF NOT EXISTS keel_schedule_pauses (
    entry     text PRIMARY KEY,
    paused_at timestamptz NOT NULL DEFAULT now(),
    paused_by text NOT NULL,
    note      text NOT NULL DEFAULT ''
);
-- What each entry is, as the schedulers running it last said (seen_at), so
-- that the operator's view shows the spec and next tick of file and code
-- entries too. An older scheduler leaves them empty.
ALTER TABLE keel_schedule ADD COLUMN IF NOT EXISTS spec text,
    ADD COLUMN IF NOT EXISTS timezone text NOT NULL DEFAULT '',
    ADD COLUMN IF NOT EXISTS kind text,
    ADD COLUMN IF NOT EXISTS seen_at timestamptz;
