-- Every action a person takes on a job (replay, discard, step resolution).
CREATE TABLE keel_audit (
    id      bigserial PRIMARY KEY,
    job_id  text NOT NULL,
    action  text NOT NULL,
    actor   text NOT NULL,
    note    text NOT NULL DEFAULT '',
    at      timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX keel_audit_job ON keel_audit (job_id, at);

-- Dead-letter filters: kind, queue and class within the dead set.
CREATE INDEX keel_jobs_dead_kind ON keel_jobs (kind, finished_at) WHERE status = 'dead';
