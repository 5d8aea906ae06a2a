package idempotency

import (
	"context"
	"net/http"

	"github.com/jackc/pgx/v5"

	"github.com/keeljobs/keel/internal/executor"
	"github.com/keeljobs/keel/internal/ledger"
)

// StepOption configures one Step (Verify).
type StepOption = executor.StepOption

// InTx runs fn in a transaction that also marks the current job succeeded:
// the handler's local effects and the completion mark commit together or not
// at all. If this run no longer holds the job's lease (another worker took
// it over, or keel gave the run up after its timeout or at shutdown) the
// transaction is rolled back and ErrLeaseLost or ErrRunGivenUp returned, so a
// job never commits twice. Call it last: recorded steps come before it.
//
// When the job's run is traced, the transaction is a keel.intx span.
func InTx(ctx context.Context, fn func(tx pgx.Tx) error) error {
	return executor.InTx(ctx, fn)
}

// Step runs an external side effect at most once per job. fn receives a
// stable idempotency key to pass to the external API. A step is one call:
// put each external call in a step of its own, and call every step before
// the job's completing InTx.
//
//   - A step that finished in an earlier attempt is skipped.
//   - fn returning an error leaves the call in doubt, unless the error says
//     the call never reached the other side (marked with NotSent) or the
//     other side refused it (a *retry.HTTPError with a 4xx status, or a 503
//     with Retry-After, as StepHTTP and DoHTTP return; any other 5xx may
//     come after the effect): only then may the step run again, with the
//     same key, on the next attempt.
//   - A step in doubt, from an error or because the process died mid-call,
//     is never called again blindly: its Verify function decides on the next
//     attempt, and without one the job goes to the dead letters with
//     ErrInDoubt for a person.
//   - A step called after the job's completing InTx does not run and
//     returns ErrStepAfterComplete.
func Step(ctx context.Context, name string, fn func(ctx context.Context, key string) error, opts ...StepOption) error {
	return executor.Step(ctx, name, fn, opts...)
}

// StepValue is Step for a call with a small result (an external id, a
// receipt number). The result is stored as JSON and returned again, without
// calling fn, on later attempts. A step finished by Verify has no stored
// result and returns T's zero value.
func StepValue[T any](ctx context.Context, name string, fn func(ctx context.Context, key string) (T, error), opts ...StepOption) (T, error) {
	return executor.StepValue(ctx, name, fn, opts...)
}

// Verify gives a step a way to find out, after a crash, whether its call
// happened (for example by asking the external API about the idempotency
// key). done = true records the step as finished without calling it again;
// done = false makes the step safe to call once more.
func Verify(fn func(ctx context.Context, key string) (done bool, err error)) StepOption {
	return executor.Verify(fn)
}

// StepKey is the stable idempotency key of a step: the same for every
// attempt of the job, different for every step.
func StepKey(jobID, name string) string {
	return executor.StepKey(jobID, name)
}

// NotSent marks an error from a step's fn as one after which the call
// certainly did not take effect: it never reached the other side (the
// request could not be built, the connection could not be made, a
// client-side rate limit refused it), or the other side answered that it
// refused it (a card declined). The step forgets its start and the next
// attempt, if the error's class allows one, calls again with the same key.
// Use it only when that is certain; any other error leaves the step in
// doubt. It keeps err's retry class. NotSent(nil) is nil.
func NotSent(err error) error {
	return executor.NotSent(err)
}

// InDoubt marks an error from a step's fn as "the call may have happened"
// (a timeout after sending, say): the step stays open for Verify or a person
// instead of being called again. Errors not marked NotSent are in doubt
// anyway; InDoubt also overrides an answer (*retry.HTTPError) that cannot be
// trusted. InDoubt(nil) is nil.
func InDoubt(err error) error {
	return executor.InDoubt(err)
}

// StepHTTP is Step for one HTTP call. newReq builds the request with the
// step's context and key; StepHTTP sends it with DoHTTP, which sets the
// Idempotency-Key header and tells whether a failed call can have reached
// the other side. The response body is read and discarded: use StepValue
// with DoHTTP to keep something from it.
//
//	err := idempotency.StepHTTP(ctx, "mail", client,
//		func(ctx context.Context, key string) (*http.Request, error) {
//			return http.NewRequestWithContext(ctx, http.MethodPost, mailURL, bytes.NewReader(body))
//		},
//		idempotency.Verify(mailer.Sent)) // the look-up that settles a call in doubt
//
// An error from newReq means nothing was sent. A nil client means
// http.DefaultClient, which has no timeout: give yours one.
func StepHTTP(ctx context.Context, name string, client *http.Client, newReq func(ctx context.Context, key string) (*http.Request, error), opts ...StepOption) error {
	return executor.StepHTTP(ctx, name, client, newReq, opts...)
}

// DoHTTP sends req once, with key in its Idempotency-Key header, and
// returns an error already marked for a step:
//
//   - the request could not be written (no connection, a dial, proxy or TLS
//     failure, a write that failed): NotSent, so the step calls again;
//   - a response arrived: a status of 400 or more is a *retry.HTTPError
//     classified by retry.FromResponse (4xx permanent; 408, 425, 429 and
//     5xx transient, honouring Retry-After); a 4xx, or a 503 with
//     Retry-After, is not in doubt, any other 5xx is (the server may have
//     failed after its effect); a 307 or 308 redirect is not followed
//     (it would send the request again) and is a permanent error; below 300
//     (and a 301, 302 or 303 that the client followed) the call is done and
//     the response is returned for the caller to read and close; a followed
//     redirect whose target fails is in doubt (the redirect answered the
//     request: after a POST, a 303 says the work is done);
//   - the request was written but no response came (a timeout, a reset
//     connection): the error is left in doubt.
//
// Go's http.Transport sends a request again by itself when a kept-alive
// connection breaks after writing it, if the request is replayable: a GET
// or any request with an Idempotency-Key header, whose body can be rewound
// (GetBody). A silent second send is exactly what a step must not do, so
// DoHTTP sends a copy of req without GetBody and with a body that is never
// nil: the transport then cannot replay it. (A request without a body thus
// goes out with an empty chunked body when its method usually has one.)
// Should a custom RoundTripper still send it twice, DoHTTP returns
// ErrResent. On error the response body is closed and the response nil.
func DoHTTP(client *http.Client, req *http.Request, key string) (*http.Response, error) {
	return executor.DoHTTP(client, req, key)
}

// JobID returns the ledger id of the job a handler is running.
func JobID(ctx context.Context) (string, bool) {
	return executor.JobID(ctx)
}

// Interrupted reports whether the run of ctx was cut short by asynq (its
// worker's shutdown, or asynq's task lease running out while Redis was
// unreachable), as the guard judges when the handler returns: the job is
// then released, its attempt not counted, so it is neither a success nor a
// failure (metrics.Worker.Middleware does not count it as one).
func Interrupted(ctx context.Context) bool {
	return executor.Interrupted(ctx)
}

// Attempt returns which attempt (1-based) of the job this run is. It is
// MaxRetry+2 on the run keel adds to the budget of a job whose first crash
// came at its last attempt (Job.ExtraRuns).
func Attempt(ctx context.Context) int {
	return executor.Attempt(ctx)
}

// WithTraceID attaches a log/trace id that keel stores with a dead job.
func WithTraceID(ctx context.Context, id string) context.Context {
	return executor.WithTraceID(ctx, id)
}

// TraceID returns the id set by WithTraceID.
func TraceID(ctx context.Context) string {
	return executor.TraceID(ctx)
}

// MaxResultBytes bounds a job's result as JSON (64 KiB).
const MaxResultBytes = executor.MaxResultBytes

// MaxProgressNoteBytes bounds a progress report's note; a longer one is
// cut.
const MaxProgressNoteBytes = executor.MaxProgressNoteBytes

// Progress reports how far the run has got: done of total (0: unknown)
// and a short note, shown by `keel status`, the inspect API and the
// dashboard's job page while the job runs, and kept after it ends.
//
// Call it as often as is convenient: keel writes at most one report per
// run an interval (server.GuardConfig.ProgressInterval, 1 s), the first
// at once and, of those that come sooner, the latest when the interval is
// up. A report not yet written when the handler returns is dropped: the
// job's status says the rest. A report is written only while this run
// holds its job as running; once keel gave the run up, the job was
// cancelled or another worker took it over, Progress returns
// ErrRunGivenUp, ErrCancelled or ErrLeaseLost (a refusal found by a write
// in the background is returned by the next call); after the completing
// InTx, ErrAlreadyCompleted; after the handler returned, ErrRunEnded. A
// handler may ignore these errors: they change nothing about the job.
func Progress(ctx context.Context, done, total int64, note string) error {
	return executor.Progress(ctx, done, total, note)
}

// SetResult stores v, as JSON of at most MaxResultBytes (ErrResultTooLarge
// beyond, a permanent error), as the job's result. It is written with the
// job's success and only with it: in the completing InTx's transaction, or,
// without one, in the statement that marks the job succeeded when the
// handler returns nil. A run that fails leaves no result; a later call
// replaces an earlier one's value; a call after the completing InTx is
// refused (ErrAlreadyCompleted). Callers read it with tasks.Client.Result,
// the inspect API, `keel status` and the dashboard, and other jobs' handlers
// with ResultOf; it is pruned with its job.
func SetResult(ctx context.Context, v any) error {
	return executor.SetResult(ctx, v)
}

// ResultOf reads the result of job id (another job's: a parent's, say)
// from a handler: ErrNotFound without such a job, ErrNoResult when it has
// none (it has not succeeded, or stored none).
func ResultOf(ctx context.Context, jobID string) (JobResult, error) {
	return executor.ResultOf(ctx, jobID)
}

// ParentResult is the result of a job this one waited for (tasks.After,
// a workflow's tasks it comes after): its id, kind, key and, in a
// workflow, its task name. JSON is nil when the parent stored no result
// (or has not succeeded: a job released by hand).
type ParentResult = ledger.ParentResult

// ParentResults returns the results of the jobs this run's job waited
// for, in id order (a parent pruned since the retention is missing). A
// fan-in's handler reads what each branch produced:
//
//	ps, err := idempotency.ParentResults(ctx)
//	for _, p := range ps {
//		var total Totals
//		if err := p.Decode(&total); err != nil { ... } // p.Task names the branch
//	}
func ParentResults(ctx context.Context) ([]ParentResult, error) {
	return executor.ParentResults(ctx)
}
