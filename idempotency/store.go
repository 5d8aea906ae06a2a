package idempotency

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

// DB is what the ledger needs from a pool or a transaction, so that every
// write can join the caller's transaction.
type DB = ledger.DB

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
}

// MaxBusinessKeyBytes bounds a business key so it always fits the unique index.
const MaxBusinessKeyBytes = 1024

// ValidateKey reports why s cannot be stored as a kind or business key:
// Postgres text cannot hold NUL bytes or invalid UTF-8, and the unique index
// has a size limit.
func ValidateKey(what, s string) error {
	switch {
	case s == "":
		return fmt.Errorf("%s is empty", what)
	case strings.TrimSpace(s) == "":
		return fmt.Errorf("%s is blank", what)
	case len(s) > MaxBusinessKeyBytes:
		return fmt.Errorf("%s is %d bytes, over the %d-byte limit", what, len(s), MaxBusinessKeyBytes)
	case !utf8.ValidString(s):
		return fmt.Errorf("%s is not valid UTF-8", what)
	}
	for i := 0; i < len(s); i++ {
		if s[i] == 0 {
			return fmt.Errorf("%s contains a NUL byte", what)
		}
	}
	return nil
}

// MaxQueueBytes bounds a queue name.
const MaxQueueBytes = 100

// ValidateQueue reports why q cannot name a queue: the one rule workers,
// kinds and clients share. Letters, digits, '-', '_' and '.': asynq keys a
// queue as asynq:{q}:…, so braces would change its hash slot, and ':' and
// ',' separate queues and weights in --queues.
func ValidateQueue(q string) error {
	if q == "" {
		return errors.New("queue name is empty")
	}
	if len(q) > MaxQueueBytes {
		return fmt.Errorf("queue name is %d bytes, over the %d-byte limit", len(q), MaxQueueBytes)
	}
	for _, r := range q {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-' || r == '_' || r == '.') {
			return fmt.Errorf("queue name %q has %q: use letters, digits, '-', '_' and '.'", q, r)
		}
	}
	return nil
}

// insertRow writes one job with ON CONFLICT DO NOTHING; insertSQL and
// insertWakeSQL differ only in its published_at.
const (
	insertRowHead = `INSERT INTO keel_jobs
	(id, kind, business_key, queue, payload, max_retry, timeout_ms, deadline, run_at, payload_summary, trace_id, max_wait_ms,
	 traceparent, tracestate, batch_id, expire_stale, published_at)
	VALUES ($1, $2, $3, $4, $5, $6, $7, $8, coalesce($9, now()), nullif($10, ''), nullif($11, ''), $12,
	 nullif($13, ''), nullif($14, ''), nullif($15, ''), $16, `
	insertRowTail = `)
	ON CONFLICT (kind, business_key) DO NOTHING
	RETURNING ` + newRowColumns
)

const insertSQL = insertRowHead + `NULL` + insertRowTail

// insertWakeSQL is insertSQL for a row the relay publishes: a due row goes
// in marked published with its place in the relay's work list (keel_outbox),
// and a relay is woken in the same round trip unless one is awake (see
// ledger.RelayAwakeLock). A row to run later goes in unpublished, for
// ClaimUnpublished at its run_at.
const insertWakeSQL = `WITH ins AS (` + insertRowHead + `CASE WHEN coalesce($9, now()) <= now() THEN now() END` + insertRowTail + `),
	outbox AS (INSERT INTO keel_outbox (job_id) SELECT id FROM ins WHERE published_at IS NOT NULL),
	wake AS (SELECT pg_notify('` + RelayChannel + `', '') FROM ins WHERE ` + wakeNeeded + `)
	SELECT * FROM ins WHERE (SELECT count(*) FROM wake) >= 0`

// A transaction that commits a NOTIFY holds a database-wide lock from its
// notify until its commit is flushed (PreCommit_Notify), so notifying
// writers commit one at a time: 16 producers were barely faster than one.
// While rows keep coming a relay therefore stays awake, polling the
// unpublished rows every few milliseconds, and writers do not notify it.
// Two advisory locks on the ledger table say who is where:
//
//   - ledger.RelayAwakeLock: the awake relay holds it exclusively. A
//     writer that can take it shared knows no relay is awake, and notifies.
//   - ledger.RelaySettleLock: every writer takes it shared, before it looks
//     at the awake lock, and keeps it until its transaction ends. A relay
//     going back to sleep lets go of the awake lock (new writers notify
//     again), then polls on until it can take this lock exclusively: every
//     writer that may have counted on it has committed or rolled back. One
//     last pass publishes what they wrote, and it lets go. A writer that
//     finds this lock taken notifies.
//
// Writers only ever try the locks (never wait), and shared locks do not
// conflict with each other, so the locks serialise nothing.
//
// The locks are the ledger package's, which the relay takes too.

// wakeNeeded is true when the writing transaction must notify: a relay is
// settling (it holds the settle lock), or none is awake. Otherwise the
// writer keeps the settle lock, shared, until it commits. CASE fixes the
// order in which the locks are tried.
const wakeNeeded = `CASE WHEN NOT pg_try_advisory_xact_lock_shared(` + ledger.RelaySettleLock + `) THEN true
		WHEN pg_try_advisory_xact_lock_shared(` + ledger.RelayAwakeLock + `) THEN true
		ELSE false END`

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
	if nj.UniqueWindow > 0 {
		if p, ok := db.(*pgxpool.Pool); ok {
			// Superseding and inserting commit together: a failed insert
			// must not leave the key with no job at all.
			err = pgx.BeginFunc(ctx, p, func(tx pgx.Tx) error {
				job, existed, err = s.Insert(ctx, tx, nj)
				return err
			})
			return job, existed, err
		}
		if err := supersede(ctx, db, []string{nj.Kind}, []string{nj.BusinessKey}, []int64{nj.UniqueWindow.Milliseconds()}); err != nil {
			return Job{}, false, err
		}
	}
	// Two tries: the conflicting row can vanish between the insert and the
	// read (pruned, or the other transaction rolled back).
	for range 2 {
		sql := insertSQL
		if nj.WakeRelay {
			sql = insertWakeSQL
		}
		var row newJobRow
		err = row.scan(db.QueryRow(ctx, sql, id.String(), nj.Kind, nj.BusinessKey, nj.Queue, nj.Payload,
			nj.MaxRetry, nj.Timeout.Milliseconds(), deadline, runAt, nj.PayloadSummary, nj.TraceID, nj.MaxWait.Milliseconds(),
			nj.TraceParent, nj.TraceState, nj.BatchID, nj.ExpireAtDeadline))
		if err == nil {
			return row.job(nj), false, nil
		}
		if !errors.Is(err, pgx.ErrNoRows) {
			return Job{}, false, interpretError(err)
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

// supersedeSQL moves aside the finished jobs of the given keys that are
// older than their key's window, so the insert that follows makes a new
// job. The rows are locked in key order (as InsertMany writes), so calls
// with overlapping keys cannot deadlock; a row another caller moved aside
// meanwhile no longer matches once its lock is granted.
const supersedeSQL = `UPDATE keel_jobs SET business_key = business_key || '#' || id,
		superseded_at = now(), updated_at = now()
	WHERE id IN (SELECT k.id FROM keel_jobs k
		JOIN unnest($1::text[], $2::text[], $3::bigint[]) AS u(kind, key, window_ms)
			ON k.kind = u.kind AND k.business_key = u.key
		WHERE u.window_ms > 0 AND k.status IN ('succeeded', 'discarded', 'dead', 'cancelled')
			AND k.created_at < now() - u.window_ms * interval '1 millisecond'
		ORDER BY k.kind, k.business_key
		FOR UPDATE OF k)`

func supersede(ctx context.Context, db DB, kinds, keys []string, windowsMS []int64) error {
	_, err := db.Exec(ctx, supersedeSQL, kinds, keys, windowsMS)
	return interpretError(err)
}

// Get returns the job with id.
func (s *Store) Get(ctx context.Context, id string) (Job, error) {
	if !utf8.ValidString(id) || id == "" {
		return Job{}, ErrNotFound
	}
	j, err := scanJob(s.pool.QueryRow(ctx, `SELECT `+jobColumns+` FROM keel_jobs WHERE id = $1`, id))
	return j, interpretError(err)
}

// FinishedAmong returns which of ids are jobs that finished for good
// (succeeded, discarded, cancelled): nothing runs them again.
func (s *Store) FinishedAmong(ctx context.Context, ids []string) (map[string]bool, error) {
	rows, err := s.pool.Query(ctx, `SELECT id FROM keel_jobs WHERE id = ANY($1)
		AND status IN ('succeeded', 'discarded', 'cancelled')`, ids)
	if err != nil {
		return nil, interpretError(err)
	}
	found, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, interpretError(err)
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
	rows, err := s.pool.Query(ctx, `SELECT job_id, name, status, result, calls, started_at, finished_at, verifiable
		FROM keel_steps WHERE job_id = ANY($1) ORDER BY job_id, started_at, name`, jobIDs)
	if err != nil {
		return nil, interpretError(err)
	}
	steps, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (StepRecord, error) {
		var st StepRecord
		err := r.Scan(&st.JobID, &st.Name, &st.Status, &st.Result, &st.Calls, &st.StartedAt, &st.FinishedAt, &st.Verifiable)
		return st, err
	})
	if err != nil {
		return nil, interpretError(err)
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
		_, err := s.pool.Exec(ctx, `UPDATE keel_jobs SET published_at = now()
			WHERE id = ANY($1) AND published_at IS NULL`, mark)
		markErr = interpretError(err)
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

// RelayChannel is the Postgres notification channel that wakes relays
// (ledger.RelayChannel).
const RelayChannel = ledger.RelayChannel

// NotifyRelay wakes the relays when tx commits (NOTIFY is delivered at commit
// and dropped on rollback).
func NotifyRelay(ctx context.Context, tx DB) error {
	_, err := tx.Exec(ctx, `SELECT pg_notify('`+RelayChannel+`', '')`)
	return interpretError(err)
}

// GetMany returns the jobs with the given ids, in no particular order.
func (s *Store) GetMany(ctx context.Context, db DB, ids []string) ([]Job, error) {
	rows, err := db.Query(ctx, `SELECT `+jobColumns+` FROM keel_jobs WHERE id = ANY($1)`, ids)
	if err != nil {
		return nil, interpretError(err)
	}
	jobs, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Job, error) { return scanJob(r) })
	return jobs, interpretError(err)
}

// LookupIn returns the job of one business action as db sees it: pass a
// transaction to see a job enqueued in it before it commits.
func LookupIn(ctx context.Context, db DB, kind, businessKey string) (Job, error) {
	if ValidateKey("kind", kind) != nil || ValidateKey("business key", businessKey) != nil {
		return Job{}, ErrNotFound
	}
	j, err := scanJob(db.QueryRow(ctx, `SELECT `+jobColumns+` FROM keel_jobs WHERE kind = $1 AND business_key = $2`, kind, businessKey))
	return j, interpretError(err)
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
		return nil, 0, interpretError(err)
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
		return nil, 0, interpretError(err)
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
	return jobs, interpretError(err)
}

// InOutbox tells whether the job waits on the relay's outbox.
func (s *Store) InOutbox(ctx context.Context, id string) (bool, error) {
	in, err := ledger.InOutbox(ctx, s.pool, id)
	return in, interpretError(err)
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
	return interpretError(ledger.Unpublish(ctx, s.pool, ids))
}
