package executor_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/jobstore"
	"github.com/keeljobs/keel/internal/testenv"
	"github.com/keeljobs/keel/retry"
	"github.com/keeljobs/keel/server"
	"github.com/keeljobs/keel/tasks"
)

var (
	traced     = tasks.Define[order]("test:traced", tasks.Key(func(o order) string { return "order:" + o.OrderID }))
	tracedDead = tasks.Define[order]("test:traced_dead", tasks.MaxRetry(0), tasks.Key(func(o order) string { return "order:" + o.OrderID }))
)

// recorder is an SDK tracer provider that keeps every ended span.
type recorder struct {
	tp  *sdktrace.TracerProvider
	exp *tracetest.InMemoryExporter
}

func newRecorder(t *testing.T) *recorder {
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	return &recorder{tp: tp, exp: exp}
}

// span waits for the ended span called name whose keel.job.id (or, for
// keel.enqueue, messaging.message.id) is jobID.
func (r *recorder) span(t *testing.T, name, jobID string) tracetest.SpanStub {
	t.Helper()
	var got tracetest.SpanStub
	testenv.Eventually(t, 20*time.Second, func() bool {
		for _, s := range r.exp.GetSpans() {
			if s.Name == name && (attr(s, "keel.job.id") == jobID || attr(s, "messaging.message.id") == jobID) {
				got = s
				return true
			}
		}
		return false
	}, "no %s span for job %s", name, jobID)
	return got
}

func (r *recorder) names() []string {
	var ns []string
	for _, s := range r.exp.GetSpans() {
		ns = append(ns, s.Name)
	}
	return ns
}

func attr(s tracetest.SpanStub, key string) string {
	for _, kv := range s.Attributes {
		if string(kv.Key) == key {
			return kv.Value.Emit()
		}
	}
	return ""
}

func tracedClient(t *testing.T, b *bundle, tp trace.TracerProvider) *tasks.Client {
	t.Helper()
	c, err := tasks.NewClient(tasks.ClientConfig{Redis: b.redis, Pool: b.pool, TracerProvider: tp})
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	return c
}

func withTracer(tp trace.TracerProvider) func(*server.Config) {
	return func(c *server.Config) { c.TracerProvider = tp }
}

// One trace from the producer's request to the handler's effects: the
// enqueue is a child of the request, the publish and the run children of
// the enqueue (whose context the row and the task carry), and the claim,
// the step and the completing InTx children of the run.
func TestTraceFollowsAJobFromEnqueueToItsEffects(t *testing.T) {
	for _, mode := range []string{"Enqueue", "EnqueueTx", "EnqueueManyTx"} {
		t.Run(mode, func(t *testing.T) {
			b := setup(t)
			rec := newRecorder(t)
			client := tracedClient(t, b, rec.tp)
			mux := tasks.NewMux()
			tasks.Handle(mux, traced, func(ctx context.Context, o order) error {
				if err := idempotency.Step(ctx, "mail", func(context.Context, string) error { return nil }); err != nil {
					return err
				}
				return idempotency.InTx(ctx, func(tx pgx.Tx) error {
					_, err := tx.Exec(ctx, `INSERT INTO effects (job_id, name) VALUES ($1, 'traced')`, o.OrderID)
					return err
				})
			})
			b.startWorker(t, mux, withTracer(rec.tp))

			ctx, request := rec.tp.Tracer("test").Start(context.Background(), "request")
			var res *tasks.Result
			var err error
			switch mode {
			case "Enqueue":
				res, err = client.Enqueue(ctx, traced.New(order{OrderID: "t1"}))
			case "EnqueueTx":
				err = pgx.BeginFunc(ctx, b.pool, func(tx pgx.Tx) error {
					res, err = client.EnqueueTx(ctx, tx, traced.New(order{OrderID: "t1"}))
					return err
				})
			case "EnqueueManyTx":
				err = pgx.BeginFunc(ctx, b.pool, func(tx pgx.Tx) error {
					rs, err := client.EnqueueManyTx(ctx, tx, traced.New(order{OrderID: "t1"}), traced.New(order{OrderID: "t2"}))
					if err == nil {
						res = rs[0]
					}
					return err
				})
			}
			require.NoError(t, err)
			request.End()
			tid := request.SpanContext().TraceID()
			id := res.Job.ID
			j := b.waitStatus(t, id, idempotency.StatusSucceeded, 20*time.Second)
			require.Equal(t, tid.String(), j.TraceID, "the job's trace id is the enqueue's")
			require.NotEmpty(t, j.TraceParent)

			var enqueue tracetest.SpanStub
			for _, s := range rec.exp.GetSpans() {
				if s.Name == "keel.enqueue" {
					enqueue = s
				}
			}
			require.Equal(t, "keel.enqueue", enqueue.Name, "spans: %v", rec.names())
			publish := rec.span(t, "keel.publish", id)
			handle := rec.span(t, "keel.handle", id)
			claim := rec.span(t, "keel.claim", id)
			step := rec.span(t, "keel.step", id)
			intx := rec.span(t, "keel.intx", id)
			for _, s := range []tracetest.SpanStub{enqueue, publish, handle, claim, step, intx} {
				require.Equal(t, tid, s.SpanContext.TraceID(), "%s is in another trace", s.Name)
			}
			require.Equal(t, request.SpanContext().SpanID(), enqueue.Parent.SpanID())
			require.Equal(t, enqueue.SpanContext.SpanID(), publish.Parent.SpanID())
			require.Equal(t, enqueue.SpanContext.SpanID(), handle.Parent.SpanID())
			for _, s := range []tracetest.SpanStub{claim, step, intx} {
				require.Equal(t, handle.SpanContext.SpanID(), s.Parent.SpanID(), "%s is not a child of keel.handle", s.Name)
			}
			require.Equal(t, trace.SpanKindProducer, enqueue.SpanKind)
			require.Equal(t, trace.SpanKindConsumer, handle.SpanKind)
			require.Equal(t, "keel", attr(handle, "messaging.system"))
			require.Equal(t, "test:traced", attr(handle, "keel.job.kind"))
			require.Equal(t, "order:t1", attr(handle, "keel.job.business_key"))
			require.Equal(t, "default", attr(handle, "messaging.destination.name"))
			require.Equal(t, "1", attr(handle, "keel.job.attempt"))
			require.Equal(t, "succeeded", attr(handle, "keel.job.outcome"))
			require.Equal(t, codes.Unset, handle.Status.Code)
			require.Equal(t, "claimed", attr(claim, "keel.claim.outcome"))
			require.Equal(t, "mail", attr(step, "keel.step.name"))
			require.Equal(t, "called", attr(step, "keel.step.outcome"))
			require.Equal(t, "false", attr(step, "keel.step.in_doubt"))
			if mode == "EnqueueManyTx" {
				require.Equal(t, "2", attr(enqueue, "messaging.batch.message_count"))
			} else {
				require.Equal(t, id, attr(enqueue, "messaging.message.id"))
				require.Equal(t, "test:traced", attr(enqueue, "keel.job.kind"))
			}
		})
	}
}

// The task Redis holds carries the row's trace context in its headers.
func TestTraceContextTravelsInTheTaskHeaders(t *testing.T) {
	b := setup(t)
	rec := newRecorder(t)
	client := tracedClient(t, b, rec.tp)
	ctx, request := rec.tp.Tracer("test").Start(context.Background(), "request")
	defer request.End()
	res, err := client.Enqueue(ctx, traced.New(order{OrderID: "hdr"}))
	require.NoError(t, err)
	require.True(t, res.Published)
	info, err := inspector(t, b).GetTaskInfo("default", res.Job.ID)
	require.NoError(t, err)
	require.Equal(t, res.Job.TraceParent, info.Headers["traceparent"])
	enqueue := rec.span(t, "keel.enqueue", res.Job.ID)
	require.Contains(t, info.Headers["traceparent"], enqueue.SpanContext.SpanID().String())
	require.Contains(t, info.Headers["traceparent"], request.SpanContext().TraceID().String())
	require.Equal(t, "order:hdr", info.Headers[jobstore.HeaderBusinessKey])
}

// A job that dies keeps its trace id although nobody called WithTraceID or
// tasks.TraceID: the enqueue's, or, for a job enqueued outside any trace,
// the run's.
func TestDeadJobKeepsItsTraceID(t *testing.T) {
	b := setup(t)
	rec := newRecorder(t)
	mux := tasks.NewMux()
	tasks.Handle(mux, tracedDead, func(ctx context.Context, o order) error {
		return retry.Permanent(errors.New("card declined"))
	})
	b.startWorker(t, mux, withTracer(rec.tp))

	ctx, request := rec.tp.Tracer("test").Start(context.Background(), "request")
	res, err := tracedClient(t, b, rec.tp).Enqueue(ctx, tracedDead.New(order{OrderID: "d1"}))
	require.NoError(t, err)
	request.End()
	j := b.waitStatus(t, res.Job.ID, idempotency.StatusDead, 20*time.Second)
	require.Equal(t, request.SpanContext().TraceID().String(), j.TraceID)
	handle := rec.span(t, "keel.handle", res.Job.ID)
	require.Equal(t, "dead", attr(handle, "keel.job.outcome"))
	require.Equal(t, "permanent", attr(handle, "error.type"))
	require.Equal(t, codes.Error, handle.Status.Code)
	require.Equal(t, request.SpanContext().TraceID(), handle.SpanContext.TraceID())

	// Enqueued untraced (b.client has no provider and ctx no span): the
	// run's trace is the one to look for.
	res, err = b.client.Enqueue(context.Background(), tracedDead.New(order{OrderID: "d2"}))
	require.NoError(t, err)
	require.Empty(t, res.Job.TraceParent)
	j = b.waitStatus(t, res.Job.ID, idempotency.StatusDead, 20*time.Second)
	handle = rec.span(t, "keel.handle", res.Job.ID)
	require.False(t, handle.Parent.IsValid(), "a run of an untraced job starts its own trace")
	require.Equal(t, handle.SpanContext.TraceID().String(), j.TraceID)

	// An id given at enqueue wins over the run's trace.
	res, err = b.client.Enqueue(context.Background(), tracedDead.New(order{OrderID: "d3"}, tasks.TraceID("req-42")))
	require.NoError(t, err)
	j = b.waitStatus(t, res.Job.ID, idempotency.StatusDead, 20*time.Second)
	require.Equal(t, "req-42", j.TraceID)
}

// A step whose call may have happened is recorded in doubt on its span.
func TestTraceStepInDoubt(t *testing.T) {
	b := setup(t)
	rec := newRecorder(t)
	mux := tasks.NewMux()
	tasks.Handle(mux, tracedDead, func(ctx context.Context, o order) error {
		return idempotency.Step(ctx, "charge", func(context.Context, string) error {
			return errors.New("connection reset after the request was written")
		})
	})
	b.startWorker(t, mux, withTracer(rec.tp))
	res, err := b.client.Enqueue(context.Background(), tracedDead.New(order{OrderID: "doubt"}))
	require.NoError(t, err)
	b.waitStatus(t, res.Job.ID, idempotency.StatusDead, 20*time.Second)
	step := rec.span(t, "keel.step", res.Job.ID)
	require.Equal(t, "in_doubt", attr(step, "keel.step.outcome"))
	require.Equal(t, "true", attr(step, "keel.step.in_doubt"))
	require.Equal(t, codes.Error, step.Status.Code)
}

// With no tracer provider anywhere keel records nothing and adds nothing:
// no trace context in the row, no header on the task. A span the caller
// started with a provider of its own still gives the job its context.
func TestTracingOffByDefault(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	res, err := b.client.Enqueue(ctx, traced.New(order{OrderID: "off"}))
	require.NoError(t, err)
	require.True(t, res.Published)
	require.Empty(t, res.Job.TraceParent)
	require.Empty(t, res.Job.TraceID)
	info, err := inspector(t, b).GetTaskInfo("default", res.Job.ID)
	require.NoError(t, err)
	require.Equal(t, map[string]string{jobstore.HeaderBusinessKey: "order:off"}, info.Headers)

	rec := newRecorder(t)
	pctx, request := rec.tp.Tracer("test").Start(ctx, "request")
	res, err = b.client.Enqueue(pctx, traced.New(order{OrderID: "off-in-trace"}))
	require.NoError(t, err)
	request.End()
	require.Equal(t, []string{"request"}, rec.names(), "keel recorded spans with no provider configured")
	require.Contains(t, res.Job.TraceParent, request.SpanContext().SpanID().String())
	require.Equal(t, request.SpanContext().TraceID().String(), res.Job.TraceID)
}

// Without a provider in the config keel uses the global one, also when it
// is set after the client was made, and set again after that; a no-op
// global is off. It sets the process's global provider: not beside the
// parallel tests, whose clients use it too.
func TestTracingUsesTheGlobalProvider(t *testing.T) {
	b := setupAlone(t)
	rec := newRecorder(t)
	client := tracedClient(t, b, nil)
	otel.SetTracerProvider(rec.tp)
	t.Cleanup(func() { otel.SetTracerProvider(noop.NewTracerProvider()) })

	res, err := client.Enqueue(context.Background(), traced.New(order{OrderID: "global"}))
	require.NoError(t, err)
	enqueue := rec.span(t, "keel.enqueue", res.Job.ID)
	require.False(t, enqueue.Parent.IsValid())
	require.Equal(t, enqueue.SpanContext.TraceID().String(), res.Job.TraceID)
	rec.span(t, "keel.publish", res.Job.ID)

	otel.SetTracerProvider(noop.NewTracerProvider())
	res, err = client.Enqueue(context.Background(), traced.New(order{OrderID: "global-noop"}))
	require.NoError(t, err)
	require.Empty(t, res.Job.TraceParent)

	// A provider set after a no-op one: the client's tracer follows it.
	again := newRecorder(t)
	otel.SetTracerProvider(again.tp)
	res, err = client.Enqueue(context.Background(), traced.New(order{OrderID: "global-again"}))
	require.NoError(t, err)
	again.span(t, "keel.enqueue", res.Job.ID)
}

// A trace context given to the store directly must be W3C's.
func TestInsertRefusesABadTraceContext(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	nj := jobstore.NewJob{Kind: "test:traced", BusinessKey: "bad-trace", Queue: "default", Payload: []byte(`{}`)}
	for _, bad := range []jobstore.NewJob{
		{TraceParent: "not a traceparent"},
		{TraceParent: "00-00000000000000000000000000000000-0000000000000000-01"},
		{TraceState: "k=v"},
	} {
		nj.TraceParent, nj.TraceState = bad.TraceParent, bad.TraceState
		_, _, err := b.store.Insert(ctx, b.pool, nj)
		require.Error(t, err, "%+v", bad)
		_, err = b.store.InsertMany(ctx, b.pool, []jobstore.NewJob{nj}, jobstore.InsertOptions{})
		require.Error(t, err, "%+v", bad)
	}
	require.Zero(t, b.count(t, `SELECT count(*) FROM keel_jobs WHERE business_key = 'bad-trace'`))

	nj.TraceParent, nj.TraceState = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "vendor=x"
	j, _, err := b.store.Insert(ctx, b.pool, nj)
	require.NoError(t, err)
	require.Equal(t, nj.TraceParent, j.TraceParent)
	require.Equal(t, "vendor=x", j.TraceState)
	require.Equal(t, map[string]string{jobstore.HeaderBusinessKey: "bad-trace",
		"traceparent": nj.TraceParent, "tracestate": "vendor=x"}, jobstore.Task(j).Headers())
}

// A run stopped because a person cancelled its job says so on its span.
func TestTraceCancelledRun(t *testing.T) {
	b := setup(t)
	rec := newRecorder(t)
	started := make(chan struct{}, 1)
	mux := tasks.NewMux()
	tasks.Handle(mux, traced, func(ctx context.Context, o order) error {
		started <- struct{}{}
		<-ctx.Done()
		return ctx.Err()
	})
	b.startWorker(t, mux, withTracer(rec.tp))
	res, err := b.client.Enqueue(context.Background(), traced.New(order{OrderID: "cancel-me"}))
	require.NoError(t, err)
	select {
	case <-started:
	case <-time.After(20 * time.Second):
		t.Fatal("the handler did not start")
	}
	_, err = b.client.Cancel(context.Background(), res.Job.ID)
	require.NoError(t, err)
	handle := rec.span(t, "keel.handle", res.Job.ID)
	require.Equal(t, "cancelled", attr(handle, "keel.job.outcome"))
	require.Equal(t, codes.Unset, handle.Status.Code)
}
