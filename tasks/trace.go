package tasks

import (
	"context"

	"go.opentelemetry.io/otel/trace"

	"github.com/keeljobs/keel/internal/jobstore"
	"github.com/keeljobs/keel/internal/tracing"
)

// enqueueSpan is one enqueue call's keel.enqueue span (nil when tracing is
// off) and the trace context its jobs are stored with: the span's, or,
// with tracing off, the caller's span's when ctx has one.
type enqueueSpan struct {
	span    trace.Span
	tc      tracing.Context
	traceID string
}

// startEnqueue starts the keel.enqueue span of a call that enqueues n
// tasks (t is the one task of a single enqueue, nil for a bulk call).
func (c *Client) startEnqueue(ctx context.Context, op string, t *Task, n int) (context.Context, enqueueSpan) {
	var es enqueueSpan
	if c.tracer.On() {
		attrs := []trace.SpanStartOption{trace.WithSpanKind(trace.SpanKindProducer), trace.WithAttributes(tracing.System,
			tracing.MessagingOperationType.String("send"), tracing.MessagingOperationName.String(op))}
		if t != nil {
			attrs = append(attrs, trace.WithAttributes(tracing.JobKind.String(t.kind),
				tracing.JobBusinessKey.String(t.s.key), tracing.MessagingDestinationName.String(t.s.queue)))
		} else {
			attrs = append(attrs, trace.WithAttributes(tracing.MessagingBatchMessageCount.Int(n)))
		}
		ctx, es.span = c.tracer.Start(ctx, tracing.SpanEnqueue, attrs...)
	}
	es.tc, es.traceID = tracing.FromContext(ctx)
	return ctx, es
}

// apply stores the call's trace context with nj; its trace id too, unless
// the task names one (tasks.TraceID).
func (es enqueueSpan) apply(nj *jobstore.NewJob) {
	if es.tc.Parent == "" {
		return
	}
	nj.TraceParent, nj.TraceState = es.tc.Parent, es.tc.State
	if nj.TraceID == "" {
		nj.TraceID = es.traceID
	}
}

// end ends the span of a single enqueue.
func (es enqueueSpan) end(res *Result, err error) {
	if es.span == nil {
		return
	}
	if res != nil {
		es.span.SetAttributes(tracing.MessagingMessageID.String(res.Job.ID), tracing.JobID.String(res.Job.ID),
			tracing.JobExisted.Bool(res.Existed))
	}
	es.finish(err)
}

// endMany ends the span of a bulk enqueue.
func (es enqueueSpan) endMany(rs []*Result, err error) {
	if es.span == nil {
		return
	}
	existed := 0
	for _, r := range rs {
		if r.Existed {
			existed++
		}
	}
	es.span.SetAttributes(tracing.JobsExisted.Int(existed))
	es.finish(err)
}

func (es enqueueSpan) finish(err error) {
	if err != nil {
		tracing.Fail(es.span, err)
	}
	es.span.End()
}
