-- keel:additive
-- A job whose handler failed after its completing InTx committed is known
-- by effects_committed_at alone: rows an older keel wrote without the
-- column (before migration 0011) are converted here, so that nothing reads
-- the error's text to find them. A binary older than 0011 must not run
-- beside this one.
UPDATE keel_jobs SET effects_committed_at = coalesce(finished_at, updated_at)
WHERE status = 'dead' AND effects_committed_at IS NULL AND error_class = 'permanent'
  AND left(coalesce(last_error, ''), 56) = 'keel: handler failed after its completing InTx committed';
