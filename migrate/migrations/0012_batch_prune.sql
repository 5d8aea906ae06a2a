-- keel:no-transaction
-- keel:additive
-- Pruning removes batches that completed longer than the retention ago once
-- their members are gone; it walks completed batches by completion time.
CREATE INDEX CONCURRENTLY IF NOT EXISTS keel_batches_completed ON keel_batches (completed_at) WHERE completed_at IS NOT NULL;
