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
-- Additive: a function only, whichever binary sets it off.
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
