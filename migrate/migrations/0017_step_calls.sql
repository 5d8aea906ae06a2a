-- keel:additive
-- Which run holds a step (run, with call_holder the worker), and until when
-- its call may still be in flight (call_until: set as the call leaves,
-- renewed by that worker while it goes on, cleared when its outcome is
-- recorded). A later run neither verifies nor calls a step whose call may
-- still be in flight: it waits until the call returned or its worker died,
-- so a call that outlived a run given up at its timeout is never made twice.
-- Outcomes are written only by the run that holds the step. An older
-- binary leaves the three NULL and behaves as before.
ALTER TABLE keel_steps
	ADD COLUMN IF NOT EXISTS run integer,
	ADD COLUMN IF NOT EXISTS call_holder text,
	ADD COLUMN IF NOT EXISTS call_until timestamptz;
