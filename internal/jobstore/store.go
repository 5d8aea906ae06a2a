package jobstore

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"
	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/keeljobs/keel/internal/asynqwire"
	"github.com/keeljobs/keel/internal/ledger"
	"github.com/keeljobs/keel/internal/tracing"
)

// Store reads and writes the ledger.
type Store struct {
	pool   *pgxpool.Pool
	tracer tracing.Tracer // keel.publish spans
}

// NewStore returns a Store on pool. The schema must be migrated (Migrate).
// Its publishes are traced with the global tracer provider
// (WithTracerProvider sets another).
func NewStore(pool *pgxpool.Pool) *Store { return &Store{pool: pool, tracer: tracing.New(nil)} }

// Pool is the pool the store uses.
func (s *Store) Pool() *pgxpool.Pool { return s.pool }

// NewJob is what Insert needs to record a business action.
type NewJob struct {
	Kind        string
	BusinessKey string
	Queue       string
	Payload     []byte
	MaxRetry    int
	Timeout     time.Duration
	MaxWait     time.Duration // zero: the worker's GuardConfig.MaxWait
	Deadline    time.Time     // zero: none
	// ExpireAtDeadline: a job still waiting when its deadline passes is
	// discarded as expired (no dead letter, no alert), not a dead letter.
	ExpireAtDeadline bool
	RunAt            time.Time // zero: now
	PayloadSummary   string
	TraceID          string
	// UniqueWindow, when positive, bounds how long the job of a key dedupes
	// once it has finished: a job of the same key enqueued when the
	// finished one (succeeded, discarded, dead or cancelled) was created
	// longer ago than this supersedes it and becomes a new job. An open job
	// (pending, running, failed) always dedupes. Zero: for as long as the
	// ledger keeps the row.
	UniqueWindow time.Duration
	// TraceParent and TraceState are the W3C trace context the job's
	// publish and runs continue (tasks.Client sets them from the enqueue's
	// span).
	TraceParent string
	TraceState  string
	// WakeRelay makes sure a relay publishes the row soon after the
	// transaction commits (EnqueueTx sets it): it notifies the relays,
	// delivered at commit, unless one is awake and polling.
	WakeRelay bool
	// BatchID makes the job a member of that open batch (see NewBatch);
	// inserting into a sealed batch fails with ErrBatchSealed. A job whose
	// key exists already is returned as it is, in whatever batch it is.
	BatchID string
	// After names the jobs this one waits for: it is written waiting and
	// runs once every one of them has succeeded (see tasks.After). Insert
	// then needs a transaction (a pool: it begins one).
	After []Ref
	// WorkflowID and WorkflowTask place the job in a workflow.
	WorkflowID, WorkflowTask string
	// ConcurrencyKey, when not empty, bounds the jobs of the kind and key
	// in flight at once to ConcurrencyLimit (at least 1): a job past it is
	// written held (status waiting) and released when one of them ends.
	ConcurrencyKey   string
	ConcurrencyLimit int
}

// Insert records nj in db (a pool or the caller's transaction). When a row for
// (kind, business key) already exists it is returned with existed = true and
// nothing is written: one business action, one job.
func (s *Store) Insert(ctx context.Context, db DB, nj NewJob) (job Job, existed bool, err error) {
	if err := ValidateNewJob(nj); err != nil {
		return Job{}, false, fmt.Errorf("keel: %w", err)
	}
	id, err := uuid.NewV7()
	if err != nil {
		return Job{}, false, err
	}
	var deadline, runAt *time.Time
	if !nj.Deadline.IsZero() {
		deadline = &nj.Deadline
	}
	if !nj.RunAt.IsZero() {
		runAt = &nj.RunAt
	}
	if nj.Payload == nil {
		nj.Payload = []byte{} // a task without a payload; the column is NOT NULL
	}
	ins := ledger.JobInsert{ID: id.String(), Kind: nj.Kind, BusinessKey: nj.BusinessKey,
		Queue: nj.Queue, Payload: nj.Payload, MaxRetry: nj.MaxRetry, TimeoutMS: nj.Timeout.Milliseconds(),
		Deadline: deadline, RunAt: runAt, PayloadSummary: nj.PayloadSummary, TraceID: nj.TraceID,
		MaxWaitMS: nj.MaxWait.Milliseconds(), TraceParent: nj.TraceParent, TraceState: nj.TraceState,
		BatchID: nj.BatchID, ExpireStale: nj.ExpireAtDeadline,
		ConcurrencyKey: nj.ConcurrencyKey, ConcurrencyLimit: nj.ConcurrencyLimit}
	dependent := len(nj.After) > 0 || nj.WorkflowID != ""
	var wait *ledger.Waiting
	if nj.UniqueWindow > 0 || dependent {
		if p, ok := db.(*pgxpool.Pool); ok {
			// Superseding and inserting commit together: a failed insert
			// must not leave the key with no job at all. A dependent's
			// parents stay locked until it commits.
			err = pgx.BeginFunc(ctx, p, func(tx pgx.Tx) error {
				job, existed, err = s.Insert(ctx, tx, nj)
				return err
			})
			return job, existed, err
		}
		if nj.UniqueWindow > 0 {
			if err := supersede(ctx, db, []string{nj.Kind}, []string{nj.BusinessKey}, []int64{nj.UniqueWindow.Milliseconds()}); err != nil {
				return Job{}, false, err
			}
		}
		if dependent {
			w, err := lockParents(ctx, db, nj)
			if err != nil {
				return Job{}, false, err
			}
			wait = &w
		}
	}
	// Two tries: the conflicting row can vanish between the insert and the
	// read (pruned, or the other transaction rolled back).
	for range 2 {
		var row ledger.NewRow
		if wait != nil {
			row, err = ledger.InsertWaiting(ctx, db, ins, *wait)
		} else {
			row, err = ledger.InsertJob(ctx, db, ins, nj.WakeRelay)
		}
		if err == nil {
			return waitingJob(newJob(row, nj), wait), false, nil
		}
		if !errors.Is(err, pgx.ErrNoRows) {
			return Job{}, false, Interpret(err)
		}
		job, err = LookupIn(ctx, db, nj.Kind, nj.BusinessKey)
		if err == nil {
			return job, true, nil
		}
		if !errors.Is(err, ErrNotFound) {
			return Job{}, false, err
		}
	}
	return Job{}, false, fmt.Errorf("keel: could not insert or find job %s/%s", nj.Kind, nj.BusinessKey)
}

func supersede(ctx context.Context, db DB, kinds, keys []string, windowsMS []int64) error {
	return Interpret(ledger.Supersede(ctx, db, kinds, keys, windowsMS))
}

// Get returns the job with id.
func (s *Store) Get(ctx context.Context, id string) (Job, error) {
	if !utf8.ValidString(id) || id == "" {
		return Job{}, ErrNotFound
	}
	j, err := ledger.GetJob(ctx, s.pool, id)
	return j, Interpret(err)
}

// FinishedAmong returns which of ids are jobs that finished for good
// (succeeded, discarded, cancelled): nothing runs them again.
func (s *Store) FinishedAmong(ctx context.Context, ids []string) (map[string]bool, error) {
	found, err := ledger.FinishedAmong(ctx, s.pool, ids)
	if err != nil {
		return nil, Interpret(err)
	}
	finished := make(map[string]bool, len(found))
	for _, id := range found {
		finished[id] = true
	}
	return finished, nil
}

// Lookup returns the job of one business action.
func (s *Store) Lookup(ctx context.Context, kind, businessKey string) (Job, error) {
	return LookupIn(ctx, s.pool, kind, businessKey)
}

// Steps returns the recorded steps of a job in the order they started.
func (s *Store) Steps(ctx context.Context, jobID string) ([]StepRecord, error) {
	steps, err := s.StepsOf(ctx, []string{jobID})
	return steps[jobID], err
}

// StepsOf returns the recorded steps of each of the jobs, in the order
// they started, in one statement.
func (s *Store) StepsOf(ctx context.Context, jobIDs []string) (map[string][]StepRecord, error) {
	steps, err := ledger.StepsOf(ctx, s.pool, jobIDs)
	if err != nil {
		return nil, Interpret(err)
	}
	out := make(map[string][]StepRecord, len(jobIDs))
	for _, st := range steps {
		out[st.JobID] = append(out[st.JobID], st)
	}
	return out, nil
}

// HeaderBusinessKey carries a job's business key in its asynq task headers,
// so logs can name it without a ledger read.
const HeaderBusinessKey = "keel-business-key"

// AsynqRetryHeadroom is how many tries asynq's own count allows beyond the
// ledger's budget. The ledger decides when a job dies (the guard archives it
// then with SkipRetry); asynq archives whatever fails on its own last try —
// waits included, such as a claim that found the row locked for a moment —
// so its last try must lie beyond the ledger's.
const AsynqRetryHeadroom = 5

// TaskOptions are the asynq options that publish j: its ledger id as task id,
// so a second publish of the same job is a harmless conflict.
func TaskOptions(j Job) []asynq.Option {
	opts := []asynq.Option{asynq.TaskID(j.ID), asynq.Queue(j.Queue), asynq.MaxRetry(j.MaxRetry + AsynqRetryHeadroom)}
	if j.Timeout > 0 {
		opts = append(opts, asynq.Timeout(asynqwire.Seconds(j.Timeout)))
	}
	if j.Deadline != nil {
		opts = append(opts, asynq.Deadline(*j.Deadline))
	}
	if j.RunAt.After(time.Now()) {
		opts = append(opts, asynq.ProcessAt(j.RunAt))
	}
	return opts
}

// PublishInFlight is how many script calls PublishMany keeps in flight at
// once, each with up to 200 jobs of one queue.
const PublishInFlight = 4

// Published is what publishing one job did.
type Published struct {
	// Err is nil when Redis holds the job.
	Err error
	// New is true when Redis got a new task; false with a nil Err when it
	// already held one under the job's id (a repeated publish).
	New bool
}

// PublishMany hands jobs to Redis and returns what happened to each, in the
// order of jobs. It is the one way keel publishes: jobs go in groups of one
// queue, up to 200 per script call, several calls in flight. The ledger id
// is the asynq task id, so an id Redis holds already counts as published. A
// call Redis refuses fails only its own group's jobs.
//
// The published jobs whose PublishedAt is nil are then marked published in
// one statement (the relay's jobs were marked when it claimed them). markErr
// is that statement's failure; it loses nothing: the jobs are in Redis, and
// the relay publishing them again is a harmless conflict.
func (s *Store) PublishMany(ctx context.Context, p *Publisher, jobs []Job) (res []Published, markErr error) {
	res = make([]Published, len(jobs))
	defer s.tracePublished(ctx, jobs, res, time.Now())
	groups := publishGroups(jobs)
	// The first group goes alone: when it finds Redis unreachable the rest
	// are not tried, since each would wait for its own dial and add to
	// go-redis's count of failed dials, which past the pool size makes it
	// refuse connections for a while after Redis is back.
	if len(groups) > 0 {
		p.publishGroup(ctx, jobs, groups[0], res)
		var err error
		for _, i := range groups[0] {
			if unreachable(res[i].Err) {
				err = res[i].Err
			}
		}
		if err != nil {
			for _, g := range groups[1:] {
				for _, i := range g {
					res[i].Err = err
				}
			}
		} else {
			var wg sync.WaitGroup
			slots := make(chan struct{}, PublishInFlight)
			for _, g := range groups[1:] {
				slots <- struct{}{}
				wg.Go(func() {
					defer func() { <-slots }()
					p.publishGroup(ctx, jobs, g, res)
				})
			}
			wg.Wait()
		}
	}
	var mark []string
	for i, j := range jobs {
		if res[i].Err == nil && j.PublishedAt == nil {
			mark = append(mark, j.ID)
		}
	}
	if len(mark) > 0 {
		markErr = Interpret(ledger.MarkPublished(ctx, s.pool, mark))
	}
	return res, markErr
}

// publishGroups splits the indexes of jobs into groups of one queue and at
// most publishChunk jobs, in order.
func publishGroups(jobs []Job) [][]int {
	byQueue := map[string][]int{}
	var order []string
	for i, j := range jobs {
		if _, ok := byQueue[j.Queue]; !ok {
			order = append(order, j.Queue)
		}
		byQueue[j.Queue] = append(byQueue[j.Queue], i)
	}
	var groups [][]int
	for _, q := range order {
		idx := byQueue[q]
		for len(idx) > 0 {
			n := min(len(idx), publishChunk)
			groups = append(groups, idx[:n])
			idx = idx[n:]
		}
	}
	return groups
}

// publishGroup publishes the jobs at idx, all of one queue, into res. A job
// asynq would refuse (a blank task type, which only a hand-written row can
// have) fails alone, as it would through asynq's client.
func (p *Publisher) publishGroup(ctx context.Context, jobs []Job, idx []int, res []Published) {
	group := make([]Job, 0, len(idx))
	at := make([]int, 0, len(idx))
	for _, i := range idx {
		if strings.TrimSpace(jobs[i].Kind) == "" {
			res[i].Err = fmt.Errorf("keel: publish job %s: task type cannot be empty", jobs[i].ID)
			continue
		}
		group, at = append(group, jobs[i]), append(at, i)
	}
	if len(group) == 0 {
		return
	}
	out := make([]Published, len(group))
	p.publish(ctx, group[0].Queue, group, out)
	for k, i := range at {
		res[i] = out[k]
	}
}

// unreachable tells whether err says Redis could not be reached.
func unreachable(err error) bool {
	var netErr net.Error
	return errors.As(err, &netErr)
}

// Task is the asynq task that carries j; publish it with TaskOptions(j).
func Task(j Job) *asynq.Task {
	return asynq.NewTaskWithHeaders(j.Kind, j.Payload, taskHeaders(j))
}

// NotifyRelay wakes the relays when tx commits (NOTIFY is delivered at commit
// and dropped on rollback).
func NotifyRelay(ctx context.Context, tx DB) error {
	return Interpret(ledger.NotifyRelay(ctx, tx))
}

// GetMany returns the jobs with the given ids, in no particular order.
func (s *Store) GetMany(ctx context.Context, db DB, ids []string) ([]Job, error) {
	jobs, err := ledger.GetJobs(ctx, db, ids)
	return jobs, Interpret(err)
}

// LookupIn returns the job of one business action as db sees it: pass a
// transaction to see a job enqueued in it before it commits.
func LookupIn(ctx context.Context, db DB, kind, businessKey string) (Job, error) {
	if ledger.ValidateKey("kind", kind) != nil || ledger.ValidateKey("business key", businessKey) != nil {
		return Job{}, ErrNotFound
	}
	j, err := ledger.LookupJob(ctx, db, kind, businessKey)
	return j, Interpret(err)
}

// ClaimOutbox, TakeOverOutbox and ClaimUnpublished return jobs with what
// publishing reads of their rows (ledger.PublishColumns), not whole rows.

// ClaimOutbox takes up to limit jobs off the outbox, where EnqueueTx and
// EnqueueManyTx put them, and returns those still to publish (see
// ledger.ClaimOutbox). It commits before it returns: nothing is locked
// while the caller talks to Redis, so a worker that receives a job at once
// can claim it. The caller publishes the jobs and hands back, with
// Unpublish, any it could not; a caller that dies in between leaves jobs
// the reconciler republishes after its grace period (their rows are marked
// published). taken is how many outbox rows it took, which can exceed
// len(jobs). An idle poll asks only whether the outbox holds a row.
func (s *Store) ClaimOutbox(ctx context.Context, limit int) (jobs []Job, taken int, err error) {
	queued, err := ledger.OutboxDue(ctx, s.pool)
	if err != nil || !queued {
		return nil, 0, Interpret(err)
	}
	return s.takeOutbox(ctx, limit, 0)
}

// TakeOverOutbox is ClaimOutbox for the rows that have waited at least age:
// the reconciler's, when no relay reads the outbox.
func (s *Store) TakeOverOutbox(ctx context.Context, limit int, age time.Duration) (jobs []Job, taken int, err error) {
	return s.takeOutbox(ctx, limit, age)
}

func (s *Store) takeOutbox(ctx context.Context, limit int, age time.Duration) (jobs []Job, taken int, err error) {
	jobs, taken, err = ledger.ClaimOutbox(ctx, s.pool, limit, age, nil)
	if err != nil {
		return nil, 0, Interpret(err)
	}
	return jobs, taken, nil
}

// ClaimUnpublished marks up to limit committed, unpublished jobs that are
// due as published and returns them, in a transaction of its own, as
// ClaimOutbox does. These are the jobs that do not go through the outbox:
// a wait handed back by a worker (a job waits in the ledger, not in Redis,
// until its run_at: it must not be published while asynq still holds its
// old copy), a job enqueued to run later, a hand-back (Unpublish), a
// replay, and rows written by a binary from before the outbox.
func (s *Store) ClaimUnpublished(ctx context.Context, limit int) ([]Job, error) {
	jobs, err := ledger.ClaimUnpublished(ctx, s.pool, limit, nil)
	return jobs, Interpret(err)
}

// InOutbox tells whether the job waits on the relay's outbox.
func (s *Store) InOutbox(ctx context.Context, id string) (bool, error) {
	in, err := ledger.InOutbox(ctx, s.pool, id)
	return in, Interpret(err)
}

// PublishClaimed publishes jobs a relay or reconciler took to publish (off
// the outbox, or claimed unpublished: marked already) and hands back, with
// Unpublish, those Redis did not take, so that a relay publishes them
// later. backErr is the hand-back's failure: those jobs wait for the
// reconciler.
func (s *Store) PublishClaimed(ctx context.Context, p *Publisher, jobs []Job) (res []Published, backErr error) {
	res, _ = s.PublishMany(ctx, p, jobs) // nothing to mark
	var back []string
	for i, r := range res {
		if r.Err != nil {
			back = append(back, jobs[i].ID)
		}
	}
	if len(back) > 0 {
		backErr = s.Unpublish(context.WithoutCancel(ctx), back)
	}
	return res, backErr
}

// Unpublish hands jobs a publisher could not publish back to the relay.
func (s *Store) Unpublish(ctx context.Context, ids []string) error {
	return Interpret(ledger.Unpublish(ctx, s.pool, ids))
}
