-- keel:additive
-- A kind with a dedupe window (tasks.Unique) lets a new job of a key in once
-- the key's finished job is older than the window. The old row keeps its
-- history: it is marked superseded and its key moved aside (key#id), so the
-- unique index holds one live job per key.
ALTER TABLE keel_jobs ADD COLUMN IF NOT EXISTS superseded_at timestamptz;
