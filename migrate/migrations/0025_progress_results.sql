-- keel:additive
-- A running job's progress as its handler last reported it, and a
-- succeeded job's result: one narrow row per job that has one, in tables
-- of their own. Columns on keel_jobs would make every report rewrite the
-- job's row and an entry in each of its indexes; here a report is a HOT
-- update of a small row (room left on each page for it), and jobs that
-- report nothing pay nothing. run is the run that wrote the report: a
-- late write of an older run never overwrites a newer one's. No foreign
-- keys: adding one would lock keel_jobs against writes while it is made,
-- and every job pruned would pay a trigger per table; the prune deletes a
-- job's rows with it. An older binary neither writes nor reads them (its
-- prune leaves the rows of the jobs it deletes behind, unread).
CREATE TABLE IF NOT EXISTS keel_job_progress (
    job_id     text PRIMARY KEY,
    run        integer NOT NULL,
    done       bigint NOT NULL,
    total      bigint NOT NULL,
    note       text NOT NULL DEFAULT '',
    updated_at timestamptz NOT NULL DEFAULT now()
) WITH (fillfactor = 70);
CREATE TABLE IF NOT EXISTS keel_job_results (
    job_id    text PRIMARY KEY,
    result    json NOT NULL,
    stored_at timestamptz NOT NULL DEFAULT now()
);
