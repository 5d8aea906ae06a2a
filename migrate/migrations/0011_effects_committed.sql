-- keel:additive
-- When a handler failed after its completing InTx committed, the job goes
-- to the dead letters with its local effects in. effects_committed_at
-- records that commit, so a replay, which would run the effects again, is
-- refused. Nullable: an older binary writes rows without it.
ALTER TABLE keel_jobs ADD COLUMN IF NOT EXISTS effects_committed_at timestamptz;
