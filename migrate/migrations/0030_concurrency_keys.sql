-- keel:no-transaction
-- keel:additive
-- Concurrency keys: a kind may name a partition of its jobs (a tenant, a
-- customer) and a limit, and at most that many jobs of one key are in
-- flight (pending, running, or failed and waiting to retry) at a time,
-- across every worker. A job whose key is full is written held: status
-- 'waiting', key_held_since set, published_at set so that neither the
-- relay nor the reconciler nor the client's own publish hands it to Redis.
-- Redis then holds at most `limit` jobs of a key, and another key's job
-- never queues behind a flood.
--
-- Admission (keel_concurrency_admit, BEFORE): a keyed row that becomes
-- pending (inserted, released by its parents, replayed) takes its key's
-- lock, counts the key's jobs in flight, and is held when they reach the
-- limit. Release (keel_concurrency_release, AFTER): a keyed job that
-- leaves flight (succeeded, dead, discarded, cancelled; not one held by
-- its kind's pause, which the resume admits again) takes the same
-- lock and moves the oldest held jobs of its key, as many as there are
-- free slots, to pending and the relay's outbox, in the ending
-- transaction, whichever statement ended it. The lock is a transaction
-- advisory lock on (ledger table, key): two inserts, or an insert and an
-- end, of one key are serialised, so a key is neither over-admitted nor
-- left with a held job and a free slot.
--
-- Both triggers fire only for rows with a concurrency_key: other jobs pay
-- nothing. Additive: an older binary writes no key, and a held row is
-- waiting to it, which none of its statements publishes or claims (each
-- names the statuses it reads); the triggers release held rows whichever
-- binary ends a keyed job.
ALTER TABLE keel_jobs ADD COLUMN IF NOT EXISTS concurrency_key text;
ALTER TABLE keel_jobs ADD COLUMN IF NOT EXISTS concurrency_limit integer;
ALTER TABLE keel_jobs ADD COLUMN IF NOT EXISTS key_held_since timestamptz;

-- A key's jobs in flight, counted at each admission and release (at most
-- about its limit: held rows are not in it), and its held jobs, oldest
-- first; a key's ended jobs leave both.
CREATE INDEX CONCURRENTLY IF NOT EXISTS keel_jobs_concurrency_flight ON keel_jobs (kind, concurrency_key)
    WHERE concurrency_key IS NOT NULL AND status IN ('pending', 'running', 'failed');
CREATE INDEX CONCURRENTLY IF NOT EXISTS keel_jobs_concurrency_held ON keel_jobs (kind, concurrency_key, created_at, id)
    WHERE concurrency_key IS NOT NULL AND status = 'waiting';

CREATE OR REPLACE FUNCTION keel_concurrency_lock(kind text, key text) RETURNS void
LANGUAGE sql AS $fn$
    SELECT pg_advisory_xact_lock(('keel_jobs'::regclass::oid::int8 & 2147483647)::int4, hashtext(kind || E'\x1f' || key))
$fn$;

-- The triggers' statements read by keel_jobs_concurrency however small
-- the table was when their plans were cached: a plan made on a nearly
-- empty ledger would otherwise scan the table, row after row of a bulk
-- insert of one key (enable_seqscan for these functions only).
CREATE OR REPLACE FUNCTION keel_concurrency_admit() RETURNS trigger
LANGUAGE plpgsql SET enable_seqscan = off AS $fn$
BEGIN
    PERFORM keel_concurrency_lock(NEW.kind, NEW.concurrency_key);
    IF (SELECT count(*) FROM keel_jobs WHERE kind = NEW.kind AND concurrency_key = NEW.concurrency_key
            AND status IN ('pending', 'running', 'failed') AND id <> NEW.id) >= NEW.concurrency_limit THEN
        NEW.status := 'waiting';
        NEW.key_held_since := now();
        NEW.published_at := coalesce(NEW.published_at, now());
    END IF;
    RETURN NEW;
END
$fn$;

CREATE OR REPLACE FUNCTION keel_concurrency_release() RETURNS trigger
LANGUAGE plpgsql SET enable_seqscan = off AS $fn$
DECLARE
    free integer;
    n integer;
BEGIN
    PERFORM keel_concurrency_lock(NEW.kind, NEW.concurrency_key);
    SELECT NEW.concurrency_limit - count(*) INTO free FROM keel_jobs
        WHERE kind = NEW.kind AND concurrency_key = NEW.concurrency_key AND status IN ('pending', 'running', 'failed');
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
    IF NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = 'keel_jobs'::regclass AND tgname = 'keel_concurrency_admit_new') THEN
        CREATE TRIGGER keel_concurrency_admit_new BEFORE INSERT ON keel_jobs
            FOR EACH ROW WHEN (NEW.concurrency_key IS NOT NULL AND NEW.status = 'pending')
            EXECUTE FUNCTION keel_concurrency_admit();
    END IF;
    -- A held job's release (waiting with key_held_since) is admitted
    -- already; a job moving within flight keeps its slot.
    IF NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = 'keel_jobs'::regclass AND tgname = 'keel_concurrency_admit') THEN
        CREATE TRIGGER keel_concurrency_admit BEFORE UPDATE OF status ON keel_jobs
            FOR EACH ROW WHEN (NEW.concurrency_key IS NOT NULL AND NEW.status = 'pending'
                AND OLD.status NOT IN ('pending', 'running', 'failed')
                AND NOT (OLD.status = 'waiting' AND OLD.key_held_since IS NOT NULL))
            EXECUTE FUNCTION keel_concurrency_admit();
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = 'keel_jobs'::regclass AND tgname = 'keel_concurrency_release') THEN
        CREATE TRIGGER keel_concurrency_release AFTER UPDATE OF status ON keel_jobs
            FOR EACH ROW WHEN (NEW.concurrency_key IS NOT NULL AND OLD.status IN ('pending', 'running', 'failed')
                AND NEW.status NOT IN ('pending', 'running', 'failed', 'paused'))
            EXECUTE FUNCTION keel_concurrency_release();
    END IF;
END
$do$;
