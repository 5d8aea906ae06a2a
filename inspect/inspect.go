package inspect

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/jobstore"
	"github.com/keeljobs/keel/internal/ledger"
	"github.com/keeljobs/keel/internal/pgerr"
	"github.com/keeljobs/keel/retry"
)

var (
	// ErrNotFound means no job has the id (or kind and business key).
	ErrNotFound = idempotency.ErrNotFound
	// ErrNotDead means a replay or discard named a job that is not (or no
	// longer) in the dead letters and cannot be moved that way.
	ErrNotDead = errors.New("keel: job is not dead")
	// ErrNoteRequired means a discard came without a note saying why.
	ErrNoteRequired = errors.New("keel: discarding a job needs a note saying why")
	// ErrActorRequired means an operator action did not say who took it.
	ErrActorRequired = errors.New("keel: operator actions need an actor (who did it)")
	// ErrStepsInDoubt means a replay was refused because a step of the job is
	// in doubt: a person must first say whether its call happened.
	ErrStepsInDoubt = errors.New("keel: job has steps in doubt; say first whether each call happened (on its dashboard page, with `keel dead resolve`, or Inspector.ResolveStep)")
	// ErrEffectsCommitted means a replay was refused because the job's
	// completing InTx committed before its handler failed: its local
	// effects are in, and running the handler again would repeat them.
	ErrEffectsCommitted = errors.New("keel: the job's completing InTx committed before its handler failed; its local effects are in and a replay would run them again: finish what came after by hand, then discard it with a note")
	// ErrTaskActive means a replay found asynq still holding the job's task
	// as running; it can act once asynq takes the task back.
	ErrTaskActive = errors.New("keel: asynq still holds the job's task as running")
	// ErrCountChanged means a bulk action's confirmed count no longer matches.
	ErrCountChanged = errors.New("keel: the number of matching jobs changed since it was confirmed")
	// ErrNotCancellable means a cancel named a job that has already ended
	// (succeeded, dead, discarded): there is nothing left to stop. The
	// error names the job's status.
	ErrNotCancellable = errors.New("keel: job cannot be cancelled")
	// ErrNotWaiting means a release named a job that has ended: only a
	// waiting job can be released.
	ErrNotWaiting = errors.New("keel: job is not waiting")
	// ErrCallInFlight means a step was said not to have happened while its
	// call may still be in flight: a worker that gave its run up still
	// renews the mark until the call returns (or the mark runs out a lease
	// after the worker dies). A replay would call it again beside it.
	ErrCallInFlight = errors.New("keel: the step's call may still be in flight")
)

// StatusError is an action refused because of the job's status: Err is
// ErrNotDead or ErrNotCancellable, Status what the job is. A discard
// refused for a job that has not finished (pending, running, failed) names
// what a cancel stops.
type StatusError struct {
	Err    error
	JobID  string
	Status idempotency.Status
}

func (e *StatusError) Error() string {
	return fmt.Sprintf("%v: job %s is %s", e.Err, e.JobID, e.Status)
}

func (e *StatusError) Unwrap() error { return e.Err }

// Config is what an Inspector works on.
type Config struct {
	// Pool holds the ledger. Required.
	Pool *pgxpool.Pool
	// Redis is asynq's Redis, where the actions remove or stop a job's
	// task. Nil (and no Asynq) leaves Redis alone: the ledger is the
	// record, and a worker acknowledges any delivery of a job closed there
	// without running it; a replay then publishes anew only once asynq's
	// archived copy has gone.
	Redis asynq.RedisConnOpt
	// Asynq is an asynq inspector already open on that Redis, used instead
	// of opening one from Redis; Close leaves it open.
	Asynq *asynq.Inspector
	// RedisClient is a client already open on that Redis, for pausing
	// queues, used instead of opening one from Redis; Close leaves it
	// open.
	RedisClient redis.UniversalClient
	// Poll is how often WaitDone reads the ledger. Default 500ms.
	Poll time.Duration
	// KnownKind reports whether a kind can be run, for AddSchedule and
	// SetSchedule to refuse an entry of another. Nil accepts every kind.
	KnownKind func(kind string) bool
}

// Validate reports what is missing or wrong in c.
func (c Config) Validate() error {
	switch {
	case c.Pool == nil:
		return errors.New("keel inspect: Config.Pool is required")
	case c.Poll < 0:
		return fmt.Errorf("keel inspect: Config.Poll %v: must not be negative", c.Poll)
	}
	return nil
}

// Inspector takes operator actions on jobs and reads what they need.
// It is safe for concurrent use.
type Inspector struct {
	pool  *pgxpool.Pool
	store *jobstore.Store
	insp  *asynq.Inspector
	poll  time.Duration
	// rdb pauses and resumes queues; ownedRDB: New opened it.
	rdb       redis.UniversalClient
	ownedRDB  bool
	knownKind func(string) bool
}

// New returns an Inspector on cfg's ledger and Redis.
func New(cfg Config) (*Inspector, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	in := &Inspector{pool: cfg.Pool, store: jobstore.NewStore(cfg.Pool), insp: cfg.Asynq, poll: cfg.Poll, knownKind: cfg.KnownKind}
	if in.poll == 0 {
		in.poll = 500 * time.Millisecond
	}
	in.rdb = cfg.RedisClient
	if in.rdb == nil && cfg.Redis != nil {
		// Every asynq.RedisConnOpt makes a go-redis universal client.
		in.rdb, in.ownedRDB = cfg.Redis.MakeRedisClient().(redis.UniversalClient), true
	}
	if in.insp == nil && in.rdb != nil {
		// On the same connections: one pool for the actions and pauses.
		in.insp = asynq.NewInspectorFromRedisClient(in.rdb)
	}
	return in, nil
}

// Close releases the Redis connection the Inspector opened, if it did.
func (in *Inspector) Close() error {
	if in.ownedRDB {
		return in.rdb.Close()
	}
	return nil
}

// interpret makes a ledger error keel's, as idempotency does.
func interpret(err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, pgx.ErrNoRows):
		return ErrNotFound
	case pgerr.Unreachable(err):
		return retry.Wait(0, fmt.Errorf("%w: %w", idempotency.ErrLedgerUnavailable, err))
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return err
	}
	return fmt.Errorf("keel ledger: %w", err)
}

func needActor(actor string) error {
	if strings.TrimSpace(actor) == "" {
		return ErrActorRequired
	}
	return nil
}

// Get returns the job id.
func (in *Inspector) Get(ctx context.Context, id string) (idempotency.Job, error) {
	return in.store.Get(ctx, id)
}

// Lookup returns the job of kind with business key.
func (in *Inspector) Lookup(ctx context.Context, kind, key string) (idempotency.Job, error) {
	return in.store.Lookup(ctx, kind, key)
}

// Steps returns the recorded steps of job id, in the order they started.
func (in *Inspector) Steps(ctx context.Context, id string) ([]idempotency.StepRecord, error) {
	return in.store.Steps(ctx, id)
}

// AuditEntry is one action a person took on a job.
type AuditEntry = ledger.AuditEntry

// Audit returns the actions people took on job id, oldest first.
func (in *Inspector) Audit(ctx context.Context, id string) ([]AuditEntry, error) {
	es, err := ledger.AuditOf(ctx, in.pool, id)
	return es, interpret(err)
}

// Record writes an entry of the audit log that goes with no change this
// package makes: a look at a job's payload, a sign-in (jobID empty), an
// action asynqmon took itself.
// Unlike the actions, it takes an empty actor: a failed sign-in may name
// nobody.
func (in *Inspector) Record(ctx context.Context, jobID, action, actor, note string) error {
	return interpret(ledger.Audit(ctx, in.pool, jobID, action, actor, note, nil))
}

// Action is what a bulk action or a dry run does.
type Action = ledger.Action

// The actions.
const (
	ActionReplay  = ledger.Replay
	ActionDiscard = ledger.Discard
	ActionCancel  = ledger.Cancel
	// ActionRelease starts waiting jobs without waiting for their parents.
	ActionRelease = ledger.ReleaseWaiting
)

// ParseAction returns the action named s: replay, discard, cancel or
// release.
func ParseAction(s string) (Action, bool) {
	switch a := Action(s); a {
	case ActionReplay, ActionDiscard, ActionCancel, ActionRelease:
		return a, true
	}
	return "", false
}

// ReplayResult says what a replay did.
type ReplayResult struct {
	Job idempotency.Job
	// AlreadyReplayed is true when the job was no longer dead (an earlier
	// replay won); nothing was changed.
	AlreadyReplayed bool
}

// Replay runs a dead job again, through the same middleware and handler,
// with a fresh retry budget. It removes asynq's archived copy (whose retry
// count is spent) and hands the ledger row back to the relay, which
// publishes it anew from the ledger, so it works even after asynq's
// archive dropped the task. Replaying a job that is no longer dead is a
// no-op (AlreadyReplayed); see the package's doc for what it refuses.
func (in *Inspector) Replay(ctx context.Context, id, actor, note string) (ReplayResult, error) {
	o, err := in.one(ctx, ActionReplay, id, actor, note)
	if err != nil {
		return ReplayResult{}, err
	}
	return ReplayResult{Job: o.job, AlreadyReplayed: o.unchanged != ""}, nil
}

// DiscardResult says what a discard did.
type DiscardResult struct {
	Job idempotency.Job
	// AlreadyDiscarded is true when the job was discarded before (by an
	// earlier call or someone else), whose resolution stays; nothing was
	// changed.
	AlreadyDiscarded bool
}

// Discard closes a dead job for good, with a required note saying why.
// Discarding a job that is already discarded is a no-op.
func (in *Inspector) Discard(ctx context.Context, id, actor, note string) (DiscardResult, error) {
	if err := needNote(ActionDiscard, note); err != nil {
		return DiscardResult{}, err
	}
	o, err := in.one(ctx, ActionDiscard, id, actor, note)
	if err != nil {
		return DiscardResult{}, err
	}
	return DiscardResult{Job: o.job, AlreadyDiscarded: o.unchanged != ""}, nil
}

func needNote(a Action, note string) error {
	if a == ActionDiscard && strings.TrimSpace(note) == "" {
		return ErrNoteRequired
	}
	return nil
}

// ReleaseResult says what a release did.
type ReleaseResult struct {
	Job idempotency.Job
	// AlreadyReleased is true when the job was no longer waiting (its
	// parents released it, or an earlier release did); nothing was changed.
	AlreadyReleased bool
}

// Release starts a waiting job (tasks.After) now, without waiting for its
// parents: a person decides the parents' outcome does not matter (one
// died and will not be replayed, say). The job goes to the relay like a
// replayed one; its parents' later success changes nothing. Releasing a
// job that no longer waits is a no-op (AlreadyReleased); a job that has
// ended is refused with ErrNotWaiting.
func (in *Inspector) Release(ctx context.Context, id, actor, note string) (ReleaseResult, error) {
	o, err := in.one(ctx, ActionRelease, id, actor, note)
	if err != nil {
		return ReleaseResult{}, err
	}
	return ReleaseResult{Job: o.job, AlreadyReleased: o.unchanged != ""}, nil
}

// CancelResult says what a cancel did.
type CancelResult struct {
	// Job is the ledger row after the cancel.
	Job idempotency.Job
	// AlreadyCancelled is true when the job was cancelled before (by an
	// earlier call or someone else); nothing was changed or audited.
	AlreadyCancelled bool
	// WasRunning is true when a worker held the job: its handler's context
	// is cancelled (asynq's CancelProcessing, and the guard at its next
	// lease renewal should that message be lost).
	WasRunning bool
	// RedisErr is why asynq's copy could not be removed or stopped, if it
	// could not. The cancel holds anyway: the ledger is the record, and a
	// worker acknowledges any later delivery without running it.
	RedisErr error
}

// Cancel closes a job that has not finished (pending, scheduled, failed
// and waiting for its retry, or running) for good. A job not running has
// its asynq task removed; a running job's handler context is cancelled and
// nothing that run does later can commit (its InTx and Step return
// idempotency.ErrCancelled). The cancel does not undo anything: a step
// whose call already left stays as it is, in doubt if it had not finished.
//
// Cancelling a cancelled job is a no-op (AlreadyCancelled); a job that has
// ended is refused with ErrNotCancellable. The job's (kind, business key)
// stays taken: enqueueing it again returns the cancelled job.
func (in *Inspector) Cancel(ctx context.Context, id, actor, note string) (CancelResult, error) {
	o, err := in.one(ctx, ActionCancel, id, actor, note)
	if err != nil {
		return CancelResult{}, err
	}
	return CancelResult{Job: o.job, AlreadyCancelled: o.unchanged != "", WasRunning: o.wasRunning, RedisErr: o.redisErr}, nil
}

// CancelByKey cancels the job of kind with business key; see Cancel.
func (in *Inspector) CancelByKey(ctx context.Context, kind, key, actor, note string) (CancelResult, error) {
	if err := needActor(actor); err != nil {
		return CancelResult{}, err
	}
	j, err := in.store.Lookup(ctx, kind, key)
	if err != nil {
		return CancelResult{}, err
	}
	return in.Cancel(ctx, j.ID, actor, note)
}

// one does action a to the job id, and reads the job as it left it.
func (in *Inspector) one(ctx context.Context, a Action, id, actor, note string) (outcome, error) {
	if err := needActor(actor); err != nil {
		return outcome{}, err
	}
	if !utf8.ValidString(id) || id == "" || strings.ContainsRune(id, 0) {
		return outcome{}, ErrNotFound
	}
	os, err := in.act(ctx, a, []string{id}, actor, note)
	if err != nil {
		return outcome{}, err
	}
	o := os[0]
	if o.err != nil {
		return o, o.err
	}
	o.job, err = in.store.Get(ctx, id)
	return o, err
}

// Progress returns job id's progress as its handler last reported it
// (idempotency.Progress); ok is false when it reported none.
func (in *Inspector) Progress(ctx context.Context, id string) (p idempotency.JobProgress, ok bool, err error) {
	return in.store.Progress(ctx, id)
}

// Result returns job id's result (idempotency.SetResult): ErrNotFound
// without such a job, idempotency.ErrNoResult when it has none.
func (in *Inspector) Result(ctx context.Context, id string) (idempotency.JobResult, error) {
	return in.store.Result(ctx, id)
}

// ResultByKey is Result for the job of kind with business key.
func (in *Inspector) ResultByKey(ctx context.Context, kind, key string) (idempotency.JobResult, error) {
	return in.store.ResultByKey(ctx, kind, key)
}
