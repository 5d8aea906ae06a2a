-- keel:additive
-- in_doubt: the job died because a call may or may not have happened
-- (idempotency.ErrInDoubt): it needs a person. Set where the death is
-- recorded, read by the dashboard's filter; rows an older keel wrote are
-- converted here from their error's text, once. An older worker leaves it
-- false, and the filter still finds its in-doubt jobs by their started
-- steps.
ALTER TABLE keel_jobs ADD COLUMN IF NOT EXISTS in_doubt boolean NOT NULL DEFAULT false;
UPDATE keel_jobs SET in_doubt = true
WHERE status = 'dead' AND NOT in_doubt AND position('in doubt: needs a person' in coalesce(last_error, '')) > 0;
