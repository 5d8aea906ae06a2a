-- keel:no-transaction
-- keel:additive
-- A keyed job its kind's pause holds keeps its concurrency slot through the
-- pause: 0030's release does not fire when it is paused, and the resume
-- admits it again. One that ends there instead (cancelled, or ended at its
-- deadline) gave nothing back, so a job of its key held for that slot stayed
-- held, after the resume too, with no job of its key in flight to release
-- it. Now its end releases as an end in flight does (keel_concurrency_release_paused),
-- and the release counts the key's paused jobs as holding slots, as many as
-- the limit at most, so the slots of the paused jobs that stay are not
-- handed out. A job released while its kind is paused is paused at its
-- delivery, as any job of a paused kind.
--
-- Additive: triggers and an index only; whichever binary ends a paused job
-- sets them off.
CREATE INDEX CONCURRENTLY IF NOT EXISTS keel_jobs_concurrency_paused ON keel_jobs (kind, concurrency_key)
    WHERE concurrency_key IS NOT NULL AND status = 'paused';

CREATE OR REPLACE FUNCTION keel_concurrency_release() RETURNS trigger
LANGUAGE plpgsql SET enable_seqscan = off AS $fn$
DECLARE
    free integer;
    n integer;
BEGIN
    PERFORM keel_concurrency_lock(NEW.kind, NEW.concurrency_key);
    SELECT NEW.concurrency_limit
        - (SELECT count(*) FROM keel_jobs
            WHERE kind = NEW.kind AND concurrency_key = NEW.concurrency_key AND status IN ('pending', 'running', 'failed'))
        - (SELECT count(*) FROM (SELECT 1 FROM keel_jobs
            WHERE kind = NEW.kind AND concurrency_key = NEW.concurrency_key AND status = 'paused'
            LIMIT NEW.concurrency_limit) p)
        INTO free;
    IF free <= 0 THEN
        RETURN NULL;
    END IF;
    WITH released AS (
        UPDATE keel_jobs j SET status = 'pending', key_held_since = NULL,
            published_at = CASE WHEN j.run_at <= now() THEN now() END, updated_at = now()
        WHERE j.id IN (SELECT id FROM keel_jobs WHERE kind = NEW.kind AND concurrency_key = NEW.concurrency_key
                AND status = 'waiting' AND key_held_since IS NOT NULL
            ORDER BY created_at, id LIMIT free FOR UPDATE)
        RETURNING j.id, j.published_at)
    INSERT INTO keel_outbox (job_id) SELECT id FROM released WHERE published_at IS NOT NULL
        ON CONFLICT DO NOTHING;
    GET DIAGNOSTICS n = ROW_COUNT;
    IF n > 0 THEN
        PERFORM pg_notify('keel_relay', '');
    END IF;
    RETURN NULL;
END
$fn$;

DO $do$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = 'keel_jobs'::regclass AND tgname = 'keel_concurrency_release_paused') THEN
        CREATE TRIGGER keel_concurrency_release_paused AFTER UPDATE OF status ON keel_jobs
            FOR EACH ROW WHEN (NEW.concurrency_key IS NOT NULL AND OLD.status = 'paused'
                AND NEW.status IN ('succeeded', 'dead', 'discarded', 'cancelled'))
            EXECUTE FUNCTION keel_concurrency_release();
    END IF;
END
$do$;
