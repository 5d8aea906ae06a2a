-- keel:no-transaction
-- keel:additive
-- A keyed batch member ended by a statement of its own (a completion with
-- a result, InTx's mark, a failure, a retirement, a deadline) fired the
-- batch's trigger, which locks the batch's row, before the key's release,
-- which takes the key's lock: the other order from a worker's round (the
-- key, then the batch) and an insert (the key in its BEFORE trigger, then
-- the batch). Two ending members of one batch and key could deadlock, and
-- the one Postgres aborted could be a failure left unwritten. The batch's
-- trigger now takes a keyed member's key lock first when the key's release
-- fires too (an end from flight or a pause); statements that end jobs of
-- several keys (a person's cancel or discard, the deadline end) take their
-- keys in key order before any row's trigger runs.
--
-- Admission counts a key's jobs in flight after taking its lock: in a
-- REPEATABLE READ or SERIALIZABLE transaction that count reads the
-- transaction's snapshot, which may predate an enqueue of the key that
-- committed meanwhile, and admitted past the limit. A keyed job admitted
-- in such a transaction (an EnqueueTx of the caller's, or any statement
-- on a server whose default_transaction_isolation is not READ COMMITTED,
-- Postgres's default) is refused (SQLSTATE KC001), saying so.
--
-- Additive: functions only, whichever binary sets them off.
CREATE OR REPLACE FUNCTION keel_batch_member_moved() RETURNS trigger
LANGUAGE plpgsql AS $fn$
DECLARE
    was_done boolean := OLD.status IN ('succeeded', 'dead', 'discarded', 'cancelled');
    is_done boolean := NEW.status IN ('succeeded', 'dead', 'discarded', 'cancelled');
    b keel_batches;
BEGIN
    IF NEW.concurrency_key IS NOT NULL AND is_done AND OLD.status IN ('pending', 'running', 'failed', 'paused') THEN
        PERFORM keel_concurrency_lock(NEW.kind, NEW.concurrency_key);
    END IF;
    UPDATE keel_batches SET
        succeeded = succeeded + (NEW.status = 'succeeded')::int - (OLD.status = 'succeeded')::int,
        dead = dead + (NEW.status = 'dead')::int - (OLD.status = 'dead')::int,
        discarded = discarded + (NEW.status = 'discarded')::int - (OLD.status = 'discarded')::int,
        cancelled = cancelled + (NEW.status = 'cancelled')::int - (OLD.status = 'cancelled')::int,
        completed_at = CASE WHEN was_done AND NOT is_done THEN NULL ELSE completed_at END,
        updated_at = now()
        WHERE id = NEW.batch_id RETURNING * INTO b;
    IF FOUND AND is_done AND NOT was_done AND b.sealed_at IS NOT NULL AND b.completed_at IS NULL
        AND b.succeeded + b.dead + b.discarded + b.cancelled >= b.total THEN
        PERFORM keel_batch_complete(b.id);
    END IF;
    RETURN NULL;
END
$fn$;

CREATE OR REPLACE FUNCTION keel_concurrency_admit() RETURNS trigger
LANGUAGE plpgsql SET enable_seqscan = off AS $fn$
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'keel: a job with a concurrency key (%, key %) is admitted only in a READ COMMITTED transaction, not %: its key''s jobs in flight are counted after its lock, which an older snapshot would miss (enqueue it in READ COMMITTED; the server''s default_transaction_isolation must be read committed)',
            NEW.kind, NEW.concurrency_key, current_setting('transaction_isolation') USING ERRCODE = 'KC001';
    END IF;
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
