package tasks

import (
	"context"
	"testing"

	"github.com/keeljobs/keel/internal/jobstore"
	"github.com/keeljobs/keel/internal/tracing"
)

// With no tracer provider anywhere an enqueue's tracing allocates nothing:
// no span is started and no trace context formatted.
func TestEnqueueTracingOffAllocatesNothing(t *testing.T) {
	c := &Client{tracer: tracing.New(nil)}
	if c.tracer.On() {
		t.Skip("a global tracer provider is set")
	}
	task := NewRaw("test:alloc", []byte(`{}`), "k")
	res := &Result{}
	ctx := context.Background()
	allocs := testing.AllocsPerRun(100, func() {
		_, span := c.startEnqueue(ctx, "enqueue", task, 1)
		var nj jobstore.NewJob
		span.apply(&nj)
		span.end(res, nil)
		_, span = c.startEnqueue(ctx, "enqueue_many", nil, 10)
		span.endMany([]*Result{res}, nil)
	})
	if allocs != 0 {
		t.Fatalf("tracing that is off allocated %v times per enqueue", allocs)
	}
}
