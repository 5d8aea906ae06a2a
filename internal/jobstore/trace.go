package jobstore

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"
	"unicode/utf8"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/keeljobs/keel/internal/tracing"
)

// A job's trace: the span that enqueued it is stored with its row
// (NewJob.TraceParent), the asynq task carries it in its headers, and the
// worker's keel.handle span continues it; keel.claim, keel.step and
// keel.intx are children of keel.handle. With no tracer provider
// configured (the global no-op) keel starts no span at all.

// WithTracerProvider returns a store on the same pool whose publishes
// record keel.publish spans with tp; nil means the global provider, as
// NewStore's does.
func (s *Store) WithTracerProvider(tp trace.TracerProvider) *Store {
	c := *s
	c.tracer = tracing.New(tp)
	return &c
}

// taskHeaders are the asynq headers of j: its business key and, when it
// was enqueued in a trace, that trace's context.
func taskHeaders(j Job) map[string]string {
	h := make(map[string]string, 3)
	eachTaskHeader(j, func(k, v string) { h[k] = v })
	return h
}

// eachTaskHeader calls fn with each header of j's asynq task: taskHeaders
// without the map, for the publisher's encoding.
func eachTaskHeader(j Job, fn func(k, v string)) {
	fn(HeaderBusinessKey, j.BusinessKey)
	if j.TraceParent != "" {
		fn(tracing.HeaderParent, j.TraceParent)
		if j.TraceState != "" {
			fn(tracing.HeaderState, j.TraceState)
		}
	}
}

// maxTraceStateBytes bounds a stored tracestate (W3C: 32 members of at most
// 256 characters each would be far larger; real ones are short).
const maxTraceStateBytes = 512

// validateTraceContext refuses a trace context that is not W3C's: the
// worker would drop it silently, and the ledger must hold what it says.
func validateTraceContext(nj NewJob) error {
	if nj.TraceParent == "" {
		if nj.TraceState != "" {
			return errors.New("trace state without a trace parent")
		}
		return nil
	}
	ctx := tracing.Context{Parent: nj.TraceParent}.Remote(context.Background())
	if !trace.SpanContextFromContext(ctx).IsValid() {
		return fmt.Errorf("trace parent %q is not a W3C traceparent", nj.TraceParent)
	}
	if len(nj.TraceState) > maxTraceStateBytes || !utf8.ValidString(nj.TraceState) {
		return fmt.Errorf("trace state is not valid UTF-8 of at most %d bytes", maxTraceStateBytes)
	}
	return nil
}

// traceContexts are the trace contexts of the jobs at idx, as the arrays of
// bulkInsertSQL: empty when none of them is traced, so untraced bulk
// enqueues send nothing more.
func traceContexts(jobs []NewJob, idx []int) (parents, states []string) {
	if !slices.ContainsFunc(idx, func(i int) bool { return jobs[i].TraceParent != "" }) {
		return []string{}, []string{}
	}
	parents, states = make([]string, len(idx)), make([]string, len(idx))
	for r, i := range idx {
		parents[r], states[r] = jobs[i].TraceParent, jobs[i].TraceState
	}
	return parents, states
}

// tracePublished records a keel.publish span, child of its enqueue's span,
// for each traced job of one PublishMany call. Publishes run several at a
// time, so each span covers the call.
func (s *Store) tracePublished(ctx context.Context, jobs []Job, res []Published, start time.Time) {
	if !s.tracer.On() {
		return
	}
	end := time.Now()
	for i, j := range jobs {
		if j.TraceParent == "" {
			continue // not enqueued in a trace: a root span per job would be noise
		}
		pctx := tracing.Context{Parent: j.TraceParent, State: j.TraceState}.Remote(ctx)
		_, span := s.tracer.Start(pctx, tracing.SpanPublish, trace.WithSpanKind(trace.SpanKindProducer),
			trace.WithTimestamp(start), trace.WithAttributes(tracing.System,
				tracing.MessagingOperationType.String("send"), tracing.MessagingOperationName.String("publish"),
				tracing.MessagingDestinationName.String(j.Queue), tracing.MessagingMessageID.String(j.ID),
				tracing.JobID.String(j.ID), tracing.JobKind.String(j.Kind)))
		if err := res[i].Err; err != nil {
			tracing.Fail(span, err)
		} else if !res[i].New {
			span.SetAttributes(attribute.Bool("keel.publish.repeated", true))
		}
		span.End(trace.WithTimestamp(end))
	}
}
