-- keel:no-transaction
-- keel:additive
-- Where dependencies meet discards, releases by hand, concurrency keys and
-- kinds' pauses.
--
-- A dependency is met once: keel_job_deps.met_at records it, at its
-- parent's success, or at the child's enqueue when the parent had
-- succeeded already or its handler had failed after its completing InTx
-- (dead with its effects in: its success had counted its children down).
-- Discarding such a parent cancelled a child it had already counted down
-- that still waited for another parent, and a child enqueued after it
-- waited for it for ever (no replay runs its effects again). Now a success
-- counts down, and an end cancels, only the children whose dependency on
-- it is not met; a success counts each once.
--
-- A child released by hand (waiting_on = 0), or released by its parents
-- and held by its concurrency key, is no longer its parents': their later
-- success let a held one past its key's limit (and into the outbox), and
-- their end cancelled it.
--
-- Admission counts a key's jobs its kind's pause holds, as the release has
-- since 0031 (as many as the limit at most): during a pause a new job of a
-- full key was admitted past the limit, and the paused job was held behind
-- it at the resume. And admission counts after taking the key's lock: in a
-- REPEATABLE READ or SERIALIZABLE transaction that count read the
-- transaction's snapshot, which may predate an enqueue of the key that
-- committed meanwhile, and admitted past the limit. A keyed job admitted in
-- such a transaction (an EnqueueTx of the caller's, or any statement on a
-- server whose default_transaction_isolation is not READ COMMITTED,
-- Postgres's default) is refused (SQLSTATE KC001), saying so.
--
-- Additive: a column older binaries never read (they write it null, as
-- before this migration), and functions their statements set off. The
-- functions come first, then met_at is filled in for the children still
-- waiting: the dependencies on parents that succeeded, and those on parents
-- dead with their effects in where the child's count shows they were
-- counted down (its unmet dependencies exceed waiting_on by as many).
ALTER TABLE keel_job_deps ADD COLUMN IF NOT EXISTS met_at timestamptz;

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
DECLARE
    n bigint;
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'keel: a job with a concurrency key (%, key %) is admitted only in a READ COMMITTED transaction, not %: its key''s jobs in flight are counted after its lock, which an older snapshot would miss (enqueue it in READ COMMITTED; the server''s default_transaction_isolation must be read committed)',
            NEW.kind, NEW.concurrency_key, current_setting('transaction_isolation') USING ERRCODE = 'KC001';
    END IF;
    PERFORM keel_concurrency_lock(NEW.kind, NEW.concurrency_key);
    SELECT count(*) INTO n FROM keel_jobs WHERE kind = NEW.kind AND concurrency_key = NEW.concurrency_key
        AND status IN ('pending', 'running', 'failed') AND id <> NEW.id;
    -- The paused ones are looked for only while there is room: a full
    -- key holds the job whatever they are.
    IF n < NEW.concurrency_limit THEN
        n := n + (SELECT count(*) FROM (SELECT 1 FROM keel_jobs
            WHERE kind = NEW.kind AND concurrency_key = NEW.concurrency_key AND status = 'paused' AND id <> NEW.id
            LIMIT NEW.concurrency_limit - n) p);
    END IF;
    IF n >= NEW.concurrency_limit THEN
        NEW.status := 'waiting';
        NEW.key_held_since := now();
        NEW.published_at := coalesce(NEW.published_at, now());
    END IF;
    RETURN NEW;
END
$fn$;

UPDATE keel_job_deps d SET met_at = now()
  FROM keel_jobs p
 WHERE p.id = d.parent_id AND d.met_at IS NULL AND p.status = 'succeeded'
   AND d.child_id IN (SELECT id FROM keel_jobs WHERE status = 'waiting');

UPDATE keel_job_deps d SET met_at = now()
  FROM keel_jobs p
 WHERE p.id = d.parent_id AND d.met_at IS NULL AND p.effects_committed_at IS NOT NULL
   AND d.child_id IN (SELECT c.id FROM keel_jobs c WHERE c.status = 'waiting'
       AND (SELECT count(*) FROM keel_job_deps u WHERE u.child_id = c.id AND u.met_at IS NULL) - c.waiting_on
         = (SELECT count(*) FROM keel_job_deps e JOIN keel_jobs ep ON ep.id = e.parent_id
             WHERE e.child_id = c.id AND e.met_at IS NULL AND ep.effects_committed_at IS NOT NULL));
