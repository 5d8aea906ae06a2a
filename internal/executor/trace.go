package executor

import (
	"context"
	"errors"
	"slices"
	"sync"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/keeljobs/keel/internal/jobstore"
	"github.com/keeljobs/keel/internal/ledger"
	"github.com/keeljobs/keel/internal/tracing"
	"github.com/keeljobs/keel/retry"
)

// handleKey finds a delivery's handleRecord in its context.
type handleKey struct{}

// handleRecord is what the guard learns about a traced delivery that its
// returned error does not say.
type handleRecord struct {
	span trace.Span

	mu     sync.Mutex // the timeout watchdog records from its own goroutine
	claim  claimOutcome
	status Status
	class  retry.Class
	run    *jobContext
}

// traceHandle wraps the guard's middleware in a keel.handle span that
// continues the trace the task's headers carry.
func (g *Guard) traceHandle(h asynq.Handler) asynq.Handler {
	return asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
		if !g.tracer.On() {
			return h.ProcessTask(ctx, t)
		}
		hdr := t.Headers()
		ctx = tracing.Context{Parent: hdr[tracing.HeaderParent], State: hdr[tracing.HeaderState]}.Remote(ctx)
		id := taskID(ctx, t)
		ctx, span := g.tracer.Start(ctx, tracing.SpanHandle, trace.WithSpanKind(trace.SpanKindConsumer),
			trace.WithAttributes(tracing.System,
				tracing.MessagingOperationType.String("process"), tracing.MessagingOperationName.String("handle"),
				tracing.MessagingDestinationName.String(queueName(ctx)), tracing.MessagingMessageID.String(id),
				tracing.JobID.String(id), tracing.JobKind.String(t.Type()),
				tracing.JobBusinessKey.String(hdr[jobstore.HeaderBusinessKey])))
		defer span.End()
		rec := &handleRecord{span: span, claim: -1}
		err := h.ProcessTask(context.WithValue(ctx, handleKey{}, rec), t)
		outcome, class := g.handleOutcome(ctx, rec, err)
		span.SetAttributes(tracing.JobOutcome.String(outcome))
		if class != "" {
			span.SetAttributes(tracing.ErrorType.String(string(class)))
		}
		switch outcome {
		case "failed", "dead", "interrupted":
			tracing.Fail(span, err)
		}
		return err
	})
}

// handleOutcome names what became of a delivery: succeeded, duplicate
// (the job had finished), postponed (a wait: no attempt used), failed (will
// retry), dead, cancelled (by a person, while it ran) or interrupted (by
// shutdown); and the error's class.
func (g *Guard) handleOutcome(ctx context.Context, rec *handleRecord, err error) (string, retry.Class) {
	rec.mu.Lock()
	defer rec.mu.Unlock()
	switch {
	case rec.run != nil && rec.run.state.Load() == runCancelled:
		return "cancelled", ""
	case rec.status == ledger.StatusDead:
		return "dead", rec.class
	case rec.status == ledger.StatusFailed:
		return "failed", rec.class
	case rec.status == ledger.StatusPending:
		return "postponed", rec.class
	case err == nil && rec.claim == claimExhausted:
		return "dead", retry.ClassCrashed
	case err == nil && (rec.claim == claimFinished || rec.claim == claimDead):
		return "duplicate", ""
	case err == nil:
		return "succeeded", ""
	case retry.IsWait(err):
		return "postponed", retry.ClassWait
	case g.stopping.Load() && errors.Is(ctx.Err(), context.Canceled):
		return "interrupted", ""
	case errors.Is(err, asynq.SkipRetry):
		return "dead", g.cfg.Classifier.Classify(err)
	}
	return "failed", g.cfg.Classifier.Classify(err)
}

// noteRun tells a traced delivery's span which run it is.
func noteRun(ctx context.Context, jc *jobContext) {
	if rec, ok := ctx.Value(handleKey{}).(*handleRecord); ok {
		rec.mu.Lock()
		rec.run = jc
		rec.mu.Unlock()
	}
}

// noteFailure tells a traced delivery's span what recordFailure decided.
func noteFailure(ctx context.Context, status Status, class retry.Class) {
	if rec, ok := ctx.Value(handleKey{}).(*handleRecord); ok {
		rec.mu.Lock()
		rec.status, rec.class = status, class
		rec.mu.Unlock()
	}
}

// spanTraceID is the trace id of a traced delivery, stored with a job that
// dies when neither its enqueue nor WithTraceID gave it one.
func spanTraceID(ctx context.Context) string {
	if _, ok := ctx.Value(handleKey{}).(*handleRecord); !ok {
		return ""
	}
	return trace.SpanContextFromContext(ctx).TraceID().String()
}

var claimOutcomes = map[claimOutcome]string{
	claimed: "claimed", claimFinished: "finished", claimDead: "dead", claimBusy: "busy",
	claimMissing: "missing", claimExhausted: "exhausted",
}

// tracedClaim is claim in a keel.claim span, when the delivery is traced.
func (g *Guard) tracedClaim(ctx context.Context, id string) claimResult {
	rec, ok := ctx.Value(handleKey{}).(*handleRecord)
	if !ok {
		return g.claim(ctx, id)
	}
	cctx, span := g.tracer.Start(ctx, tracing.SpanClaim, trace.WithAttributes(tracing.JobID.String(id)))
	defer span.End()
	res := g.claim(cctx, id)
	if res.err != nil {
		tracing.Fail(span, res.err)
		return res
	}
	span.SetAttributes(tracing.ClaimOutcome.String(claimOutcomes[res.outcome]))
	if res.outcome == claimed {
		span.SetAttributes(tracing.JobAttempt.Int(res.attempts))
		rec.span.SetAttributes(tracing.JobAttempt.Int(res.attempts))
	}
	rec.mu.Lock()
	rec.claim = res.outcome
	rec.mu.Unlock()
	return res
}

// InTx is idempotency.InTx.
func InTx(ctx context.Context, fn func(tx pgx.Tx) error) error {
	jc, err := jobFrom(ctx)
	if err != nil || !jc.guard.tracer.On() {
		return inTx(ctx, fn)
	}
	ctx, span := jc.guard.tracer.Start(ctx, tracing.SpanInTx,
		trace.WithAttributes(tracing.JobID.String(jc.id), tracing.JobAttempt.Int(jc.attempt)))
	defer span.End()
	err = inTx(ctx, fn)
	if err != nil {
		tracing.Fail(span, err)
	}
	return err
}

// Step outcomes on keel.step spans.
const (
	stepCalled   = "called"   // fn ran and succeeded: recorded done
	stepSkipped  = "skipped"  // done in an earlier attempt: fn not called
	stepVerified = "verified" // in doubt, and Verify said it happened
	stepFailed   = "failed"   // fn failed and certainly did not take effect
	stepInDoubt  = "in_doubt" // fn may have taken effect: Verify or a person decides
	stepRefused  = "refused"  // not run: after InTx, lease lost, a bad name
)

// tracedStep is StepValue in a keel.step span, when the job's run is traced.
func tracedStep[T any](ctx context.Context, jc *jobContext, name string, fn func(ctx context.Context, key string) (T, error), opts []StepOption) (T, error) {
	ctx, span := jc.guard.tracer.Start(ctx, tracing.SpanStep, trace.WithAttributes(tracing.StepName.String(name),
		tracing.JobID.String(jc.id), tracing.JobAttempt.Int(jc.attempt)))
	defer span.End()
	var called, verified, verifiedDone bool
	counted := func(ctx context.Context, key string) (T, error) {
		called = true
		return fn(ctx, key)
	}
	opts = append(slices.Clip(opts), stepOptionFunc(func(c *stepConfig) {
		if verify := c.verify; verify != nil {
			c.verify = func(ctx context.Context, key string) (bool, error) {
				done, err := verify(ctx, key)
				verified, verifiedDone = true, done && err == nil
				return done, err
			}
		}
	}))
	v, err := stepValue(ctx, name, counted, opts...)
	var outcome string
	switch {
	case err == nil && called:
		outcome = stepCalled
	case err == nil && verifiedDone:
		outcome = stepVerified
	case err == nil:
		outcome = stepSkipped
	case errors.Is(err, ErrInDoubt):
		outcome = stepInDoubt
	case called:
		outcome = stepFailed
	default:
		outcome = stepRefused
	}
	span.SetAttributes(tracing.StepOutcome.String(outcome), tracing.StepInDoubt.Bool(outcome == stepInDoubt))
	if verified {
		span.SetAttributes(attribute.Bool("keel.step.verified", true))
	}
	if err != nil {
		tracing.Fail(span, err)
	}
	return v, err
}
