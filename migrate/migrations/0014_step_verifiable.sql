-- keel:additive
-- Whether the run that started a step could Verify it. A dead job whose
-- steps in doubt are all verifiable can be replayed without a person's word
-- on each call: the replayed run asks Verify before it calls again. An older
-- binary writes false, and such a step waits for a person, as before.
ALTER TABLE keel_steps ADD COLUMN IF NOT EXISTS verifiable boolean NOT NULL DEFAULT false;
