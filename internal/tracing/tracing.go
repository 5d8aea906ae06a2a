// Package tracing holds what keel's packages share to trace a job from its
// enqueue to its effects with OpenTelemetry: the tracer, the test that
// tracing is off, and the job's W3C trace context.
package tracing

import (
	"context"
	"strings"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
)

// ScopeName is keel's instrumentation scope.
const ScopeName = "github.com/keeljobs/keel"

// Span names.
const (
	SpanEnqueue = "keel.enqueue"
	SpanPublish = "keel.publish"
	SpanClaim   = "keel.claim"
	SpanHandle  = "keel.handle"
	SpanStep    = "keel.step"
	SpanInTx    = "keel.intx"
)

// Attribute keys: OpenTelemetry's messaging conventions where one fits,
// keel.* for the rest.
const (
	MessagingSystem            = attribute.Key("messaging.system")
	MessagingOperationType     = attribute.Key("messaging.operation.type")
	MessagingOperationName     = attribute.Key("messaging.operation.name")
	MessagingDestinationName   = attribute.Key("messaging.destination.name")
	MessagingMessageID         = attribute.Key("messaging.message.id")
	MessagingBatchMessageCount = attribute.Key("messaging.batch.message_count")
	ErrorType                  = attribute.Key("error.type")

	JobKind        = attribute.Key("keel.job.kind")
	JobID          = attribute.Key("keel.job.id")
	JobBusinessKey = attribute.Key("keel.job.business_key")
	JobAttempt     = attribute.Key("keel.job.attempt")
	JobExisted     = attribute.Key("keel.job.existed")
	JobsExisted    = attribute.Key("keel.jobs.existed")
	JobOutcome     = attribute.Key("keel.job.outcome")
	ClaimOutcome   = attribute.Key("keel.claim.outcome")
	StepName       = attribute.Key("keel.step.name")
	StepOutcome    = attribute.Key("keel.step.outcome")
	StepInDoubt    = attribute.Key("keel.step.in_doubt")
)

// System is keel's messaging.system.
var System = MessagingSystem.String("keel")

// Tracer is keel's tracer, from a configured provider or the global one.
// Its zero value is off.
type Tracer struct {
	t      trace.Tracer
	global bool
}

// New returns the tracer of tp; a nil tp means the global provider, looked
// at on every span, so one set after keel's clients were made is used.
func New(tp trace.TracerProvider) Tracer {
	if tp == nil {
		return Tracer{t: otel.GetTracerProvider().Tracer(ScopeName), global: true}
	}
	if _, ok := tp.(noop.TracerProvider); ok {
		return Tracer{}
	}
	return Tracer{t: tp.Tracer(ScopeName)}
}

// unset is the global provider before anyone sets one: a no-op. Comparing
// with it cannot panic: a provider of another type is simply unequal.
var unset = otel.GetTracerProvider()

// On reports whether spans may be recorded. When it is false keel starts
// no span, so tracing that is off costs a comparison and no allocation.
func (t Tracer) On() bool {
	if t.t == nil {
		return false
	}
	if !t.global {
		return true
	}
	tp := otel.GetTracerProvider()
	if _, ok := tp.(noop.TracerProvider); ok {
		return false
	}
	return tp != unset
}

// Start starts a span; call it only when On. The global provider's tracer
// is asked for anew: a tracer taken from a provider set before (a no-op,
// say) would keep using it.
func (t Tracer) Start(ctx context.Context, name string, opts ...trace.SpanStartOption) (context.Context, trace.Span) {
	if t.global {
		return otel.GetTracerProvider().Tracer(ScopeName).Start(ctx, name, opts...)
	}
	return t.t.Start(ctx, name, opts...)
}

// Fail marks span failed with err.
func Fail(span trace.Span, err error) {
	span.RecordError(err)
	span.SetStatus(codes.Error, firstLine(err.Error()))
}

func firstLine(s string) string {
	if i := strings.IndexByte(s, '\n'); i >= 0 {
		return s[:i]
	}
	return s
}

// Context is a job's W3C trace context, as the ledger row and the asynq
// task's headers keep it.
type Context struct {
	Parent string // traceparent
	State  string // tracestate
}

// HeaderParent and HeaderState are the W3C header names, used as the asynq
// task headers that carry a job's trace context.
const (
	HeaderParent = "traceparent"
	HeaderState  = "tracestate"
)

// FromContext returns the trace context of the span in ctx, and its trace
// id; zero values when ctx holds no valid span context (nothing is
// formatted then).
func FromContext(ctx context.Context) (Context, string) {
	sc := trace.SpanContextFromContext(ctx)
	if !sc.IsValid() {
		return Context{}, ""
	}
	var c Context
	propagation.TraceContext{}.Inject(ctx, &c)
	return c, sc.TraceID().String()
}

// Set implements propagation.TextMapCarrier.
func (c *Context) Set(key, value string) {
	switch key {
	case HeaderParent:
		c.Parent = value
	case HeaderState:
		c.State = value
	}
}

// Get implements propagation.TextMapCarrier.
func (c *Context) Get(key string) string {
	switch key {
	case HeaderParent:
		return c.Parent
	case HeaderState:
		return c.State
	}
	return ""
}

// Keys implements propagation.TextMapCarrier.
func (c *Context) Keys() []string { return []string{HeaderParent, HeaderState} }

// Remote returns ctx with c as its remote parent span context; ctx as it is
// when c is empty or malformed.
func (c Context) Remote(ctx context.Context) context.Context {
	if c.Parent == "" {
		return ctx
	}
	return propagation.TraceContext{}.Extract(ctx, &c)
}
