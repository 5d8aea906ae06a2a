-- keel:no-transaction
-- keel:additive
-- Where dependencies meet replays, discards, releases by hand, concurrency
-- keys and kinds' pauses.
--
-- A dependency is met once: keel_job_deps.met_at records its parent's
-- success. A parent that succeeded, died after its completing InTx (its
-- effects in, its children counted down) and was replayed to success again
-- counted its children down a second time, releasing a child before its
-- other parents had succeeded; discarded instead, it cancelled a child it
-- had already counted down. Now a success counts down only the children
-- whose dependency on it is not met yet, and an end cancels only those.
--
-- A child released by hand (waiting_on = 0), or released by its parents
-- and held by its concurrency key, is no longer its parents': their later
-- success let a held one past its key's limit (and into the outbox), and
-- their end cancelled it.
--
-- Admission counts a key's jobs its kind's pause holds, as the release has
-- since 0031 (as many as the limit at most): during a pause a new job of a
-- full key was admitted past the limit, and the paused job was held behind
-- it at the resume.
--
-- Additive: a column older binaries never read, and functions their
-- statements set off; the met_at of the dependencies whose parent has
-- succeeded, or has died after its completing InTx, is filled in for the
-- children still waiting.
ALTER TABLE keel_job_deps ADD COLUMN IF NOT EXISTS met_at timestamptz;

UPDATE keel_job_deps d SET met_at = now()
  FROM keel_jobs p
 WHERE p.id = d.parent_id AND d.met_at IS NULL
   AND (p.status = 'succeeded' OR (p.status IN ('dead', 'discarded') AND p.effects_committed_at IS NOT NULL))
   AND d.child_id IN (SELECT id FROM keel_jobs WHERE status = 'waiting');

-- A parent's status moved into succeeded, cancelled or discarded. The
-- children it still holds back are locked in id order first: two parents
-- sharing children then wait for each other instead of deadlocking.
CREATE OR REPLACE FUNCTION keel_parent_moved() RETURNS trigger
LANGUAGE plpgsql AS $fn$
DECLARE
    n integer;
    why text := 'parent ' || NEW.id || ' was ' || NEW.status;
BEGIN
    PERFORM 1 FROM keel_jobs WHERE id IN (SELECT child_id FROM keel_job_deps WHERE parent_id = NEW.id AND met_at IS NULL)
        AND status = 'waiting' AND waiting_on > 0 ORDER BY id FOR UPDATE;
    IF NEW.status = 'succeeded' THEN
        WITH met AS (
            UPDATE keel_job_deps SET met_at = now() WHERE parent_id = NEW.id AND met_at IS NULL
            RETURNING child_id),
        released AS (
            UPDATE keel_jobs c SET waiting_on = c.waiting_on - 1,
                status = CASE WHEN c.waiting_on <= 1 THEN 'pending' ELSE c.status END,
                published_at = CASE WHEN c.waiting_on > 1 THEN c.published_at
                    WHEN c.run_at <= now() THEN now() END,
                updated_at = now()
            FROM met
            WHERE c.id = met.child_id AND c.status = 'waiting' AND c.waiting_on > 0
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
            WHERE d.parent_id = NEW.id AND d.met_at IS NULL AND c.id = d.child_id
                AND c.status = 'waiting' AND c.waiting_on > 0
            RETURNING c.id)
        INSERT INTO keel_audit (job_id, action, actor, note) SELECT id, 'cancel', 'keel', why FROM gone;
    END IF;
    RETURN NULL;
END
$fn$;

CREATE OR REPLACE FUNCTION keel_concurrency_admit() RETURNS trigger
LANGUAGE plpgsql SET enable_seqscan = off AS $fn$
BEGIN
    PERFORM keel_concurrency_lock(NEW.kind, NEW.concurrency_key);
    IF (SELECT count(*) FROM keel_jobs WHERE kind = NEW.kind AND concurrency_key = NEW.concurrency_key
            AND status IN ('pending', 'running', 'failed') AND id <> NEW.id)
        + (SELECT count(*) FROM (SELECT 1 FROM keel_jobs
            WHERE kind = NEW.kind AND concurrency_key = NEW.concurrency_key AND status = 'paused' AND id <> NEW.id
            LIMIT NEW.concurrency_limit) p) >= NEW.concurrency_limit THEN
        NEW.status := 'waiting';
        NEW.key_held_since := now();
        NEW.published_at := coalesce(NEW.published_at, now());
    END IF;
    RETURN NEW;
END
$fn$;
