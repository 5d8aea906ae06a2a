-- keel:additive
-- Paused queues, as a person paused them (keel queue pause, the dashboard,
-- asynqmon's button through keel). asynq keeps a queue's pause in Redis
-- only, where a Redis that loses its data forgets it; this row is the
-- record, and every reconciler pass pauses in Redis each queue it names.
-- A resume deletes the row once Redis has the queue unpaused. Additive:
-- an older binary never reads it.
CREATE TABLE IF NOT EXISTS keel_pauses (
    queue     text PRIMARY KEY,
    paused_at timestamptz NOT NULL DEFAULT now(),
    paused_by text NOT NULL,
    note      text NOT NULL DEFAULT ''
);
