-- keel:additive
-- Whether the job's current or last run ran alone on its worker. A worker
-- that dies takes every job it runs down with it, and only one of them may
-- have killed it: a job whose run ended in a crash runs alone on its worker
-- afterwards (the guard waits until its worker runs nothing else), and
-- only a crash of such a run counts against its retry budget. A crash of a
-- run in company is not its attempt. An older binary writes false.
ALTER TABLE keel_jobs ADD COLUMN IF NOT EXISTS solo boolean NOT NULL DEFAULT false;
