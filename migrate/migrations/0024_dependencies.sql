-- keel:no-transaction
-- keel:additive
-- Dependencies: a job may wait for other jobs (its parents) to succeed.
-- It is written with status 'waiting' and waiting_on = the number of its
-- parents not yet succeeded, one keel_job_deps row per parent, and every
-- parent marked has_dependents (an update that also locks the parent's row
-- until the child's transaction commits, so a parent cannot succeed unseen
-- between the child's look at it and its commit).
--
-- A parent's move into succeeded counts down its waiting children in the
-- same transaction (a trigger, whichever statement makes the move: the
-- guard's rounds, InTx, a resolved step). The child whose count reaches 0
-- becomes pending and goes to the relay's outbox. Two last parents
-- finishing at once are serialised by the child's row: only one brings the
-- count to 0. A parent cancelled or discarded cancels its waiting children
-- (and theirs, through the same trigger), audited. A dead parent leaves
-- them waiting: its replay, once it succeeds, releases them.
--
-- The trigger fires only for rows with has_dependents: other jobs pay
-- nothing. A waiting row is written with published_at set: it is not the
-- relay's (nor the unpublished backlog's) until released.
--
-- Additive: an older binary never writes 'waiting' and skips such rows in
-- every statement it runs (each names the statuses it reads); its pruner
-- leaves a pruned child's keel_job_deps rows behind, which nothing reads.
ALTER TABLE keel_jobs DROP CONSTRAINT IF EXISTS keel_jobs_status_check,
    ADD CONSTRAINT keel_jobs_status_check
    CHECK (status IN ('waiting', 'pending', 'running', 'succeeded', 'failed', 'dead', 'discarded', 'cancelled')) NOT VALID;
ALTER TABLE keel_jobs VALIDATE CONSTRAINT keel_jobs_status_check;

ALTER TABLE keel_jobs ADD COLUMN IF NOT EXISTS waiting_on integer NOT NULL DEFAULT 0;
ALTER TABLE keel_jobs ADD COLUMN IF NOT EXISTS has_dependents boolean NOT NULL DEFAULT false;
-- A workflow's jobs: its id (chosen by the caller) and each job's task name.
ALTER TABLE keel_jobs ADD COLUMN IF NOT EXISTS workflow_id text;
ALTER TABLE keel_jobs ADD COLUMN IF NOT EXISTS workflow_task text;

CREATE TABLE IF NOT EXISTS keel_job_deps (
    parent_id text NOT NULL,
    child_id  text NOT NULL,
    PRIMARY KEY (parent_id, child_id)
);
CREATE INDEX CONCURRENTLY IF NOT EXISTS keel_job_deps_child ON keel_job_deps (child_id);

CREATE INDEX CONCURRENTLY IF NOT EXISTS keel_jobs_waiting ON keel_jobs (created_at) WHERE status = 'waiting';
CREATE INDEX CONCURRENTLY IF NOT EXISTS keel_jobs_workflow ON keel_jobs (workflow_id) WHERE workflow_id IS NOT NULL;

-- A parent's status moved into succeeded, cancelled or discarded. The
-- children are locked in id order first: two parents sharing children
-- then wait for each other instead of deadlocking.
CREATE OR REPLACE FUNCTION keel_parent_moved() RETURNS trigger
LANGUAGE plpgsql AS $fn$
DECLARE
    n integer;
    why text := 'parent ' || NEW.id || ' was ' || NEW.status;
BEGIN
    PERFORM 1 FROM keel_jobs WHERE id IN (SELECT child_id FROM keel_job_deps WHERE parent_id = NEW.id)
        AND status = 'waiting' ORDER BY id FOR UPDATE;
    IF NEW.status = 'succeeded' THEN
        WITH released AS (
            UPDATE keel_jobs c SET waiting_on = c.waiting_on - 1,
                status = CASE WHEN c.waiting_on <= 1 THEN 'pending' ELSE c.status END,
                published_at = CASE WHEN c.waiting_on > 1 THEN c.published_at
                    WHEN c.run_at <= now() THEN now() END,
                updated_at = now()
            FROM keel_job_deps d
            WHERE d.parent_id = NEW.id AND c.id = d.child_id AND c.status = 'waiting'
            RETURNING c.id, c.status, c.published_at)
        INSERT INTO keel_outbox (job_id)
            SELECT id FROM released WHERE status = 'pending' AND published_at IS NOT NULL
            ON CONFLICT DO NOTHING;
        GET DIAGNOSTICS n = ROW_COUNT;
        IF n > 0 THEN
            PERFORM pg_notify('keel_relay', '');
        END IF;
    ELSE
        WITH gone AS (
            UPDATE keel_jobs c SET status = 'cancelled', resolved_by = 'keel', resolution_note = why,
                finished_at = now(), updated_at = now()
            FROM keel_job_deps d
            WHERE d.parent_id = NEW.id AND c.id = d.child_id AND c.status = 'waiting'
            RETURNING c.id)
        INSERT INTO keel_audit (job_id, action, actor, note) SELECT id, 'cancel', 'keel', why FROM gone;
    END IF;
    RETURN NULL;
END
$fn$;

DO $do$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = 'keel_jobs'::regclass AND tgname = 'keel_parent_moved') THEN
        CREATE TRIGGER keel_parent_moved AFTER UPDATE OF status ON keel_jobs
            FOR EACH ROW WHEN (NEW.has_dependents AND OLD.status IS DISTINCT FROM NEW.status
                AND NEW.status IN ('succeeded', 'cancelled', 'discarded'))
            EXECUTE FUNCTION keel_parent_moved();
    END IF;
END
$do$;
