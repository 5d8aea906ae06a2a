-- keel:additive
-- The W3C trace context of the span that enqueued a job (traceparent,
-- tracestate): the relay publishes the job later from its row, and the
-- worker's spans continue that trace. Nullable: an older binary writes
-- rows without it.
ALTER TABLE keel_jobs
    ADD COLUMN IF NOT EXISTS traceparent text,
    ADD COLUMN IF NOT EXISTS tracestate  text;
