-- keel:no-transaction
-- keel:additive
-- Batches: a group of jobs whose callback job is enqueued once every member
-- has ended. A member's batch_id is set when it is written and never
-- changes; the counters move in triggers, so in the same transaction as the
-- member's insert or status change, whichever statement makes it (the
-- guard's rounds, InTx, a replay, a discard, a cancel, a retirement). A
-- crash can then never lose or double a count. The triggers fire only for
-- rows with a batch_id: other jobs pay nothing.
--
-- The batch row is the lock: a member's transition updates it, so two last
-- members finishing at once on two workers are serialised, and only the one
-- that brings the terminal count to the total (of a sealed batch not yet
-- completed) enqueues the callback, in its own transaction.
--
-- Every statement may run again (no-transaction: the index is built
-- concurrently, without blocking writes to keel_jobs).
CREATE TABLE IF NOT EXISTS keel_batches (
    id              text PRIMARY KEY,
    description     text NOT NULL DEFAULT '',
    -- The callbacks: {kind, queue, max_retry, timeout_ms, max_wait_ms, data}.
    on_complete     jsonb,
    on_success      jsonb,
    total           integer NOT NULL DEFAULT 0,
    succeeded       integer NOT NULL DEFAULT 0,
    dead            integer NOT NULL DEFAULT 0,
    discarded       integer NOT NULL DEFAULT 0,
    cancelled       integer NOT NULL DEFAULT 0,
    -- How many times the batch completed: a replayed member reopens it.
    generation      integer NOT NULL DEFAULT 0,
    sealed_at       timestamptz,
    completed_at    timestamptz,
    complete_job_id text,
    success_job_id  text,
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now()
);

ALTER TABLE keel_jobs ADD COLUMN IF NOT EXISTS batch_id text;

CREATE INDEX CONCURRENTLY IF NOT EXISTS keel_jobs_batch ON keel_jobs (batch_id) WHERE batch_id IS NOT NULL;
CREATE INDEX CONCURRENTLY IF NOT EXISTS keel_batches_created ON keel_batches (created_at);
-- Open batches, for the list's filter and the keel_batches_open gauge.
CREATE INDEX CONCURRENTLY IF NOT EXISTS keel_batches_open ON keel_batches (created_at) WHERE completed_at IS NULL;

-- keel_batch_callback enqueues one callback job of batch b (generation
-- already advanced) and returns its id. The business key names the batch,
-- the event and the generation, so the ledger dedupes it like any key.
CREATE OR REPLACE FUNCTION keel_batch_callback(b keel_batches, event text, spec jsonb) RETURNS text
LANGUAGE plpgsql AS $fn$
DECLARE
    key text := 'batch:' || b.id || ':' || event || ':' || b.generation;
    jid text;
BEGIN
    -- A version 7 uuid, like the ids keel makes in Go.
    jid := encode(set_bit(set_bit(overlay(uuid_send(gen_random_uuid()) PLACING
        substring(int8send(floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint) FROM 3)
        FROM 1 FOR 6), 52, 1), 53, 1), 'hex')::uuid::text;
    INSERT INTO keel_jobs (id, kind, business_key, queue, payload, max_retry, timeout_ms, max_wait_ms)
    VALUES (jid, spec->>'kind', key, spec->>'queue',
        convert_to(jsonb_build_object(
            'batch_id', b.id, 'generation', b.generation, 'event', event, 'description', b.description,
            'counts', jsonb_build_object('total', b.total, 'succeeded', b.succeeded, 'dead', b.dead,
                'discarded', b.discarded, 'cancelled', b.cancelled),
            'data', spec->'data')::text, 'UTF8'),
        coalesce((spec->>'max_retry')::int, 10), coalesce((spec->>'timeout_ms')::bigint, 0),
        coalesce((spec->>'max_wait_ms')::bigint, 0))
    ON CONFLICT (kind, business_key) DO NOTHING
    RETURNING id INTO jid;
    IF NOT FOUND THEN
        SELECT j.id INTO jid FROM keel_jobs j WHERE j.kind = spec->>'kind' AND j.business_key = key;
    END IF;
    RETURN jid;
END
$fn$;

-- keel_batch_complete completes batch bid, whose row the caller has locked
-- and found sealed, not completed, every member terminal: it advances the
-- generation and enqueues the callbacks (on_success only when every member
-- succeeded), for the relay to publish after commit.
CREATE OR REPLACE FUNCTION keel_batch_complete(bid text) RETURNS void
LANGUAGE plpgsql AS $fn$
DECLARE
    b keel_batches;
    cid text;
    sid text;
BEGIN
    UPDATE keel_batches SET generation = generation + 1, completed_at = now(), updated_at = now()
        WHERE id = bid RETURNING * INTO b;
    IF b.on_complete IS NOT NULL THEN
        cid := keel_batch_callback(b, 'complete', b.on_complete);
    END IF;
    IF b.on_success IS NOT NULL AND b.succeeded = b.total THEN
        sid := keel_batch_callback(b, 'success', b.on_success);
    END IF;
    IF cid IS NOT NULL OR sid IS NOT NULL THEN
        UPDATE keel_batches SET complete_job_id = coalesce(cid, complete_job_id),
            success_job_id = coalesce(sid, success_job_id) WHERE id = bid;
        PERFORM pg_notify('keel_relay', '');
    END IF;
END
$fn$;

-- A member joins its batch: refused once the batch is sealed.
CREATE OR REPLACE FUNCTION keel_batch_member_added() RETURNS trigger
LANGUAGE plpgsql AS $fn$
BEGIN
    UPDATE keel_batches SET total = total + 1, updated_at = now()
        WHERE id = NEW.batch_id AND sealed_at IS NULL;
    IF NOT FOUND THEN
        IF EXISTS (SELECT 1 FROM keel_batches WHERE id = NEW.batch_id) THEN
            RAISE EXCEPTION 'keel: batch % is sealed', NEW.batch_id USING ERRCODE = 'KB001';
        END IF;
        RAISE EXCEPTION 'keel: batch % not found', NEW.batch_id USING ERRCODE = 'KB002';
    END IF;
    RETURN NULL;
END
$fn$;

-- A member's status changed into, out of, or between terminal statuses.
-- Leaving one (a replayed dead job) reopens a completed batch; the
-- transition that makes a sealed batch's last member terminal completes it.
CREATE OR REPLACE FUNCTION keel_batch_member_moved() RETURNS trigger
LANGUAGE plpgsql AS $fn$
DECLARE
    was_done boolean := OLD.status IN ('succeeded', 'dead', 'discarded', 'cancelled');
    is_done boolean := NEW.status IN ('succeeded', 'dead', 'discarded', 'cancelled');
    b keel_batches;
BEGIN
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

-- keel_batch_seal seals batch bid (again: a no-op) and completes it when
-- every member has already ended. It returns the batch row.
CREATE OR REPLACE FUNCTION keel_batch_seal(bid text) RETURNS SETOF keel_batches
LANGUAGE plpgsql AS $fn$
DECLARE
    b keel_batches;
BEGIN
    UPDATE keel_batches SET sealed_at = coalesce(sealed_at, now()), updated_at = now()
        WHERE id = bid RETURNING * INTO b;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'keel: batch % not found', bid USING ERRCODE = 'KB002';
    END IF;
    IF b.completed_at IS NULL AND b.succeeded + b.dead + b.discarded + b.cancelled >= b.total THEN
        PERFORM keel_batch_complete(bid);
    END IF;
    RETURN QUERY SELECT * FROM keel_batches WHERE id = bid;
END
$fn$;

DO $do$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = 'keel_jobs'::regclass AND tgname = 'keel_batch_member_added') THEN
        CREATE TRIGGER keel_batch_member_added AFTER INSERT ON keel_jobs
            FOR EACH ROW WHEN (NEW.batch_id IS NOT NULL)
            EXECUTE FUNCTION keel_batch_member_added();
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = 'keel_jobs'::regclass AND tgname = 'keel_batch_member_moved') THEN
        CREATE TRIGGER keel_batch_member_moved AFTER UPDATE OF status ON keel_jobs
            FOR EACH ROW WHEN (NEW.batch_id IS NOT NULL AND OLD.status IS DISTINCT FROM NEW.status
                AND (OLD.status IN ('succeeded', 'dead', 'discarded', 'cancelled')
                  OR NEW.status IN ('succeeded', 'dead', 'discarded', 'cancelled')))
            EXECUTE FUNCTION keel_batch_member_moved();
    END IF;
END
$do$;
