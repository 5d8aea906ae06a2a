-- keel:additive
-- keel_lease_lost raises when a completing InTx's run no longer holds its
-- job. The completion mark calls it when it matched no row, and the COMMIT
-- sent behind the mark in the same round trip then never runs: the
-- handler's writes roll back. An older keel does not call it.
CREATE OR REPLACE FUNCTION keel_lease_lost(job_id text) RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    RAISE EXCEPTION 'keel: job % is no longer held by this run', job_id USING ERRCODE = 'KL001';
END
$$;
