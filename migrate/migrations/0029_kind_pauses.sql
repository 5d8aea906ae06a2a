-- keel:no-transaction
-- keel:additive
-- Paused kinds. asynq has no pause below a queue, so keel holds a paused
-- kind's jobs in the ledger: keel_kind_pauses is the record of a person's
-- pause, and a job of a paused kind that no run holds gets the status
-- 'paused' (at the pause, or at the claim of a delivery that comes later,
-- which is then acknowledged). Nothing publishes or claims a paused job;
-- the resume makes them pending and unpublished, for the relay. The
-- paused jobs' index serves the resume and the count per kind.
--
-- Additive: an older binary never writes 'paused' and skips such rows in
-- every statement it runs (each names the statuses it reads); its claims
-- do not read keel_kind_pauses, so a worker one version behind still runs a
-- paused kind's jobs enqueued during the pause.
ALTER TABLE keel_jobs DROP CONSTRAINT IF EXISTS keel_jobs_status_check,
    ADD CONSTRAINT keel_jobs_status_check
    CHECK (status IN ('waiting', 'pending', 'paused', 'running', 'succeeded', 'failed', 'dead', 'discarded', 'cancelled')) NOT VALID;
ALTER TABLE keel_jobs VALIDATE CONSTRAINT keel_jobs_status_check;

CREATE TABLE IF NOT EXISTS keel_kind_pauses (
    kind      text PRIMARY KEY,
    paused_at timestamptz NOT NULL DEFAULT now(),
    paused_by text NOT NULL,
    note      text NOT NULL DEFAULT ''
);

CREATE INDEX CONCURRENTLY IF NOT EXISTS keel_jobs_paused ON keel_jobs (kind, run_at) WHERE status = 'paused';
-- A held job's deadline still ends it: reconcilers find those past it here.
CREATE INDEX CONCURRENTLY IF NOT EXISTS keel_jobs_paused_deadline ON keel_jobs (deadline) WHERE status = 'paused' AND deadline IS NOT NULL;
