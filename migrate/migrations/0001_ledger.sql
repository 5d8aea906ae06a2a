-- The ledger: one row per business action (kind, business_key).
CREATE TABLE keel_jobs (
    id              text PRIMARY KEY,
    kind            text NOT NULL,
    business_key    text NOT NULL,
    queue           text NOT NULL,
    payload         bytea NOT NULL,
    status          text NOT NULL DEFAULT 'pending'
                    CHECK (status IN ('pending', 'running', 'succeeded', 'failed', 'dead', 'discarded')),
    attempts        integer NOT NULL DEFAULT 0,
    max_retry       integer NOT NULL,
    timeout_ms      bigint NOT NULL DEFAULT 0,
    deadline        timestamptz,
    run_at          timestamptz NOT NULL DEFAULT now(),
    published_at    timestamptz,
    lease_holder    text,
    lease_until     timestamptz,
    last_error      text,
    error_class     text,
    trace_id        text,
    payload_summary text,
    resolution_note text,
    resolved_by     text,
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now(),
    finished_at     timestamptz,
    CONSTRAINT keel_jobs_kind_business_key UNIQUE (kind, business_key)
) WITH (fillfactor = 80);

-- The relay's work list: committed rows not yet handed to Redis.
CREATE INDEX keel_jobs_unpublished ON keel_jobs (run_at) WHERE published_at IS NULL;
-- Dead letters wait for a person; the dashboard lists them newest first.
CREATE INDEX keel_jobs_dead ON keel_jobs (finished_at) WHERE status = 'dead';

-- Recorded steps: external side effects of a job, one row per (job, step).
CREATE TABLE keel_steps (
    job_id      text NOT NULL REFERENCES keel_jobs (id) ON DELETE CASCADE,
    name        text NOT NULL,
    status      text NOT NULL CHECK (status IN ('started', 'done')),
    result      bytea,
    calls       integer NOT NULL DEFAULT 1,
    started_at  timestamptz NOT NULL DEFAULT now(),
    finished_at timestamptz,
    PRIMARY KEY (job_id, name)
);
