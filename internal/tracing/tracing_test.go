package tracing

import (
	"context"
	"testing"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
)

func TestOn(t *testing.T) {
	sdk := sdktrace.NewTracerProvider()
	defer func() { _ = sdk.Shutdown(context.Background()) }()
	for _, c := range []struct {
		name string
		tp   trace.TracerProvider
		on   bool
	}{
		{"the unset global", nil, false},
		{"an explicit no-op", noop.NewTracerProvider(), false},
		{"an SDK provider", sdk, true},
	} {
		if got := New(c.tp).On(); got != c.on {
			t.Errorf("%s: On() = %v, want %v", c.name, got, c.on)
		}
	}
	if (Tracer{}).On() {
		t.Error("the zero Tracer is on")
	}
}

func TestContextRoundTrip(t *testing.T) {
	sdk := sdktrace.NewTracerProvider()
	defer func() { _ = sdk.Shutdown(context.Background()) }()
	ctx, span := sdk.Tracer("test").Start(context.Background(), "parent")
	defer span.End()
	tc, traceID := FromContext(ctx)
	if traceID != span.SpanContext().TraceID().String() || tc.Parent == "" {
		t.Fatalf("FromContext = %+v, %q", tc, traceID)
	}
	got := trace.SpanContextFromContext(tc.Remote(context.Background()))
	if got.TraceID() != span.SpanContext().TraceID() || got.SpanID() != span.SpanContext().SpanID() || !got.IsRemote() {
		t.Fatalf("Remote gave %+v", got)
	}
	if tc, id := FromContext(context.Background()); tc != (Context{}) || id != "" {
		t.Fatalf("a context without a span gave %+v, %q", tc, id)
	}
	if ctx := (Context{Parent: "garbage"}).Remote(context.Background()); trace.SpanContextFromContext(ctx).IsValid() {
		t.Fatal("a malformed traceparent gave a valid span context")
	}
}
