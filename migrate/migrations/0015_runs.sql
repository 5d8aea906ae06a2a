-- keel:additive
-- run numbers each claim of a job and never goes back: with lease_holder it
-- names one run, so a run handed back uncounted (a deploy, a wait), whose
-- attempt is counted again by the next run, cannot act for that next run.
-- solo_run is the run that ran alone on its worker (-1: none): a crash of
-- that run is the job's own. extra_runs is what keel added to the job's
-- budget so that a job whose first crash came at its last run runs once
-- more, alone, before it can be retired as a poison job. An older binary
-- leaves all three alone and retires such a job as before.
ALTER TABLE keel_jobs
	ADD COLUMN IF NOT EXISTS run integer NOT NULL DEFAULT 0,
	ADD COLUMN IF NOT EXISTS solo_run integer NOT NULL DEFAULT -1,
	ADD COLUMN IF NOT EXISTS extra_runs integer NOT NULL DEFAULT 0;
