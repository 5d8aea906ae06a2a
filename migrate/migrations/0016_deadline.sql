-- keel:additive
-- What a job still waiting when its deadline passes becomes. By default a
-- dead letter of class 'deadline', for a person; with expire_stale (its
-- kind's tasks.ExpireAtDeadline) stale work has no value: it is discarded,
-- class 'expired', with no alert, and cannot be replayed by mistake. An
-- older binary writes false, and never ends a job at its deadline at all.
ALTER TABLE keel_jobs ADD COLUMN IF NOT EXISTS expire_stale boolean NOT NULL DEFAULT false;
