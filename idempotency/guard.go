package idempotency

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"
	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"

	"github.com/keeljobs/keel/retry"
)

// Defaults of GuardConfig.
const (
	// DefaultLease is short so that a killed worker's jobs are taken over
	// in seconds (the reconciler's rescuer redelivers them once it expires);
	// it is renewed every Lease/5, so a live worker misses four renewals
	// before it loses a job.
	DefaultLease       = 10 * time.Second
	DefaultLedgerRetry = 10 * time.Second
	DefaultBatchSize   = 128
	// DefaultBatchLoops is how many rounds of claims and completions run at
	// once. One round at a time gathers the most requests per statement,
	// and claims skip locked rows, so a long transaction does not stall it.
	DefaultBatchLoops   = 1
	completionMarkTries = 4
	busyRecheck         = 5 * time.Second
)

// GuardConfig configures the ledger middleware.
type GuardConfig struct {
	// Holder names this worker in lease rows. Default: host/pid/random.
	Holder string
	// Lease is how long a claim lasts without renewal; it is renewed every
	// Lease/5 while the handler runs (until its deadline), so only a dead
	// worker's lease expires. Default 10s.
	Lease time.Duration
	// LedgerRetry is how long to wait before trying a task again when the
	// ledger cannot be reached. Such waits do not use up attempts. Default 10s.
	LedgerRetry time.Duration
	// Classifier names the class stored with a failure. Default retry.Default.
	Classifier *retry.Classifier
	// Summarize returns the payload summary stored with a dead job; it is where
	// secrets are redacted. Default: the payload's first 512 bytes as text.
	Summarize func(kind string, payload []byte) string
	// OnDead is called after a job is marked dead (alerts hook in here).
	OnDead func(ctx context.Context, j DeadEvent)
	// Logger; default slog.Default().
	Logger *slog.Logger
	// BatchSize bounds how many claims or completions share one statement.
	// Default 128.
	BatchSize int
}

// DeadEvent describes a job that has just died.
type DeadEvent struct {
	JobID, Kind, Queue, BusinessKey, Class, Error, TraceID string
	Attempts                                               int
}

func (c GuardConfig) withDefaults() GuardConfig {
	if c.Holder == "" {
		host, _ := os.Hostname()
		c.Holder = fmt.Sprintf("%s/%d/%s", host, os.Getpid(), uuid.NewString()[:8])
	}
	if c.Lease <= 0 {
		c.Lease = DefaultLease
	}
	if c.LedgerRetry <= 0 {
		c.LedgerRetry = DefaultLedgerRetry
	}
	if c.Classifier == nil {
		c.Classifier = retry.Default
	}
	if c.Summarize == nil {
		c.Summarize = defaultSummary
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.BatchSize <= 0 {
		c.BatchSize = DefaultBatchSize
	}
	return c
}

func defaultSummary(_ string, payload []byte) string {
	const max = 512
	s := payload
	if len(s) > max {
		s = s[:max]
	}
	return string([]rune(string(s))) // drops invalid UTF-8 so Postgres accepts it
}

// GuardStats are counters since the guard started.
type GuardStats struct {
	Claimed, Succeeded, Failed, Dead, DuplicatesSkipped, LeaseBusy, LedgerErrors uint64
}

// Guard is the ledger middleware: it claims each delivery's job with a lease
// before the handler runs, acknowledges deliveries of finished jobs without
// running anything, and moves the row along the state machine afterwards.
type Guard struct {
	store *Store
	cfg   GuardConfig

	ledger *batcher[ledgerReq] // claims and completions, in shared rounds

	mu      sync.Mutex
	running map[string]int

	stats struct {
		claimed, succeeded, failed, dead, skipped, busy, ledgerErrs atomic.Uint64
	}

	stopRenew context.CancelFunc
	renewDone chan struct{}
	closeOnce sync.Once
}

// NewGuard starts a guard on store. Close it after the server has stopped.
func NewGuard(store *Store, cfg GuardConfig) *Guard {
	cfg = cfg.withDefaults()
	g := &Guard{store: store, cfg: cfg, running: map[string]int{}, renewDone: make(chan struct{})}
	g.ledger = newBatcher(DefaultBatchLoops, cfg.BatchSize, g.runRound)
	ctx, cancel := context.WithCancel(context.Background())
	g.stopRenew = cancel
	go g.renewLoop(ctx)
	return g
}

// Holder is the name this guard writes into lease rows.
func (g *Guard) Holder() string { return g.cfg.Holder }

// Stats returns the guard's counters.
func (g *Guard) Stats() GuardStats {
	return GuardStats{
		Claimed: g.stats.claimed.Load(), Succeeded: g.stats.succeeded.Load(), Failed: g.stats.failed.Load(),
		Dead: g.stats.dead.Load(), DuplicatesSkipped: g.stats.skipped.Load(), LeaseBusy: g.stats.busy.Load(),
		LedgerErrors: g.stats.ledgerErrs.Load(),
	}
}

// Close stops the guard's background loops.
func (g *Guard) Close() {
	g.closeOnce.Do(func() {
		g.stopRenew()
		<-g.renewDone
		g.ledger.close()
	})
}

type claimOutcome int

const (
	claimed claimOutcome = iota
	claimFinished
	claimDead
	claimBusy
	claimMissing
)

type claimResult struct {
	outcome    claimOutcome
	attempts   int
	maxRetry   int
	leaseUntil time.Time
	status     Status
	err        error
}

// ledgerReq is one claim or one completion waiting for the next round.
type ledgerReq struct {
	id       string
	complete bool
	claimOut chan claimResult // claims
	doneOut  chan error       // completions
}

// roundSQL completes the jobs in $4 (only where this worker still holds the
// lease) and claims the jobs in $3 (only where they are claimable), in one
// statement and one commit. Claims skip rows another transaction has locked
// (a handler's InTx, a relay): those are reported busy and looked at again
// later, so one long transaction cannot stall every other claim behind it.
// A job never appears in both lists (runRound sees to it): a statement may
// not update one row twice.
const roundSQL = `WITH done AS (
	UPDATE keel_jobs SET status = 'succeeded', lease_holder = NULL,
		lease_until = NULL, finished_at = now(), updated_at = now(),
		last_error = CASE WHEN error_class = 'wait' THEN NULL ELSE last_error END,
		error_class = CASE WHEN error_class = 'wait' THEN NULL ELSE error_class END
	WHERE id = ANY($4) AND status = 'running' AND lease_holder = $1
	RETURNING id),
free AS (
	SELECT id FROM keel_jobs WHERE id = ANY($3)
	  AND (status IN ('pending', 'failed') OR (status = 'running' AND lease_until < now()))
	FOR UPDATE SKIP LOCKED),
c AS (
	UPDATE keel_jobs j SET status = 'running', lease_holder = $1,
		lease_until = now() + $2 * interval '1 millisecond',
		attempts = j.attempts + 1, updated_at = now(),
		published_at = coalesce(j.published_at, now())
	FROM free WHERE j.id = free.id
	RETURNING j.id, j.attempts, j.max_retry)
SELECT id, 0, 0 FROM done
UNION ALL
SELECT id, attempts, max_retry FROM c`

// unclaimedSQL reads why jobs could not be claimed (the rare path).
const unclaimedSQL = `SELECT id, status, attempts, coalesce(lease_until, now()) FROM keel_jobs WHERE id = ANY($1)`

// runRound runs one round of waiting claims and completions: one statement
// in the common case, a second one only for claims that did not succeed.
func (g *Guard) runRound(ctx context.Context, reqs []ledgerReq) {
	var claimIDs, doneIDs []string
	completing := map[string]bool{}
	for _, r := range reqs {
		if r.complete {
			doneIDs = append(doneIDs, r.id)
			completing[r.id] = true
		}
	}
	// A claim of a job this worker is completing in this very round is a
	// duplicate delivery of a job it holds: busy (the next look finds it
	// finished). Every other id is claimed once; later copies are busy.
	asked := map[string]bool{}
	for _, r := range reqs {
		if !r.complete && !completing[r.id] && !asked[r.id] {
			claimIDs = append(claimIDs, r.id)
			asked[r.id] = true
		}
	}
	if claimIDs == nil {
		claimIDs = []string{}
	}
	if doneIDs == nil {
		doneIDs = []string{}
	}
	results := make(map[string]claimResult, len(claimIDs))
	done := make(map[string]bool, len(doneIDs))
	rows, err := g.store.pool.Query(ctx, roundSQL, g.cfg.Holder, g.cfg.Lease.Milliseconds(), claimIDs, doneIDs)
	if err == nil {
		for rows.Next() {
			var id string
			var attempts, maxRetry int
			if err = rows.Scan(&id, &attempts, &maxRetry); err != nil {
				break
			}
			if completing[id] {
				done[id] = true
			} else {
				results[id] = claimResult{outcome: claimed, attempts: attempts, maxRetry: maxRetry, status: StatusRunning}
			}
		}
		rows.Close()
		if err == nil {
			err = rows.Err()
		}
	}
	// The round committed: a failure to read why some claims did not take
	// concerns only those claims.
	var explainErr error
	if err == nil && len(results) < len(claimIDs) {
		explainErr = g.explainUnclaimed(ctx, claimIDs, results)
	}
	busy := claimResult{outcome: claimBusy, status: StatusRunning, leaseUntil: time.Now().Add(g.cfg.Lease)}
	for _, r := range reqs {
		if r.complete {
			switch {
			case err != nil:
				r.doneOut <- err
			case !done[r.id]:
				r.doneOut <- ErrLeaseLost
			default:
				r.doneOut <- nil
			}
			continue
		}
		if err != nil {
			r.claimOut <- claimResult{err: err}
			continue
		}
		if completing[r.id] {
			r.claimOut <- busy
			continue
		}
		res, ok := results[r.id]
		switch {
		case !ok && explainErr != nil:
			r.claimOut <- claimResult{err: explainErr}
			continue
		case !ok:
			res.outcome = claimMissing
		}
		// Two deliveries of one job in one round: only the first gets it.
		if res.outcome == claimed {
			results[r.id] = busy
		}
		r.claimOut <- res
	}
}

// explainUnclaimed fills results with the outcome of each claim that did not
// take: finished, dead, busy (held by a live lease, or locked) or missing.
func (g *Guard) explainUnclaimed(ctx context.Context, ids []string, results map[string]claimResult) error {
	var rest []string
	for _, id := range ids {
		if _, ok := results[id]; !ok {
			rest = append(rest, id)
		}
	}
	rows, err := g.store.pool.Query(ctx, unclaimedSQL, rest)
	if err != nil {
		return err
	}
	defer rows.Close()
	for rows.Next() {
		var id string
		var res claimResult
		if err := rows.Scan(&id, &res.status, &res.attempts, &res.leaseUntil); err != nil {
			return err
		}
		switch {
		case res.status.Terminal():
			res.outcome = claimFinished
		case res.status == StatusDead:
			res.outcome = claimDead
		default:
			res.outcome = claimBusy
		}
		results[id] = res
	}
	return rows.Err()
}

func (g *Guard) claim(ctx context.Context, id string) claimResult {
	out := make(chan claimResult, 1)
	if err := g.ledger.submit(ctx, ledgerReq{id: id, claimOut: out}); err != nil {
		return claimResult{err: err}
	}
	select {
	case res := <-out:
		return res
	case <-ctx.Done():
		// The claim may still land; its lease then expires on its own.
		return claimResult{err: ctx.Err()}
	case <-g.ledger.closed:
		return claimResult{err: ErrGuardClosed}
	}
}

func (g *Guard) complete(ctx context.Context, id string) error {
	out := make(chan error, 1)
	if err := g.ledger.submit(ctx, ledgerReq{id: id, complete: true, doneOut: out}); err != nil {
		return err
	}
	select {
	case err := <-out:
		return err
	case <-ctx.Done():
		return ctx.Err()
	case <-g.ledger.closed:
		return ErrGuardClosed
	}
}

func (g *Guard) track(id string) {
	g.mu.Lock()
	g.running[id]++
	g.mu.Unlock()
}

func (g *Guard) untrack(id string) {
	g.mu.Lock()
	if g.running[id]--; g.running[id] <= 0 {
		delete(g.running, id)
	}
	g.mu.Unlock()
}

// renewLoop extends the leases of every job this worker is running, in one
// statement, so that only a dead worker's lease ever expires.
func (g *Guard) renewLoop(ctx context.Context) {
	defer close(g.renewDone)
	t := time.NewTicker(g.cfg.Lease / 5)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		g.mu.Lock()
		ids := make([]string, 0, len(g.running))
		for id := range g.running {
			ids = append(ids, id)
		}
		g.mu.Unlock()
		if len(ids) == 0 {
			continue
		}
		_, err := g.store.pool.Exec(ctx, `UPDATE keel_jobs SET lease_until = now() + $1 * interval '1 millisecond'
			WHERE id = ANY($2) AND lease_holder = $3 AND status = 'running'`, g.cfg.Lease.Milliseconds(), ids, g.cfg.Holder)
		if err != nil && ctx.Err() == nil {
			g.cfg.Logger.Warn("keel: lease renewal failed", "jobs", len(ids), "err", err)
		}
	}
}

// Middleware returns the asynq middleware. Install it before the handler and
// after panic recovery and logging.
func (g *Guard) Middleware(next asynq.Handler) asynq.Handler {
	return asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
		id := taskID(ctx, t)
		if ValidateKey("task id", id) != nil {
			// Not a ledger id, and one Postgres cannot even hold: it must not
			// share (and fail) a round with the others.
			return fmt.Errorf("%w: task id %q: %w", ErrUnknownJob, id, asynq.SkipRetry)
		}
		res := g.claim(ctx, id)
		if res.err != nil {
			g.stats.ledgerErrs.Add(1)
			return retry.Wait(g.cfg.LedgerRetry, fmt.Errorf("keel: ledger unavailable, job %s not started: %w", id, res.err))
		}
		switch res.outcome {
		case claimFinished, claimDead:
			g.stats.skipped.Add(1)
			g.cfg.Logger.Debug("keel: duplicate delivery acknowledged", "job_id", id, "status", res.status)
			return nil
		case claimBusy:
			g.stats.busy.Add(1)
			// Look again soon: the holder usually finishes well before its
			// lease ends, and a dead holder's lease ends on its own.
			wait := min(time.Until(res.leaseUntil)+time.Second, busyRecheck)
			return retry.Wait(max(wait, time.Second), ErrLeaseHeld)
		case claimMissing:
			return fmt.Errorf("%w: job %s: %w", ErrUnknownJob, id, asynq.SkipRetry)
		}
		g.stats.claimed.Add(1)

		jc := &jobContext{guard: g, id: id, attempt: res.attempts}
		g.track(id)
		herr := next.ProcessTask(retry.WithRetried(withJob(ctx, jc), res.attempts-1), t)
		g.untrack(id)

		if jc.completed.Load() {
			// InTx committed the job's completion: it is done whatever the
			// handler did after it, and a retry would find it finished.
			if herr != nil {
				g.cfg.Logger.Warn("keel: handler failed after its InTx committed; the job stays succeeded",
					"job_id", id, "err", herr)
			}
			g.stats.succeeded.Add(1)
			return nil
		}
		if herr == nil {
			return g.markSucceeded(ctx, id)
		}
		return g.recordFailure(ctx, t, id, res, herr)
	})
}

func (g *Guard) markSucceeded(ctx context.Context, id string) error {
	// The handler's work is done; a cancelled handler context must not stop
	// us recording it, or the next delivery would run it again.
	ctx = context.WithoutCancel(ctx)
	var err error
	for try := range completionMarkTries {
		if try > 0 {
			time.Sleep(time.Duration(try*try) * 100 * time.Millisecond)
		}
		if err = g.complete(ctx, id); err == nil || errors.Is(err, ErrLeaseLost) {
			break
		}
	}
	switch {
	case err == nil:
		g.stats.succeeded.Add(1)
		return nil
	case errors.Is(err, ErrLeaseLost):
		// Another worker took the job over while this one ran; its run decides.
		g.cfg.Logger.Warn("keel: lease lost before completion was recorded", "job_id", id)
		return nil
	default:
		g.stats.ledgerErrs.Add(1)
		return retry.Wait(g.cfg.LedgerRetry, fmt.Errorf("keel: job %s finished but the ledger could not record it: %w", id, err))
	}
}

const failSQL = `UPDATE keel_jobs SET status = $3, last_error = $4, error_class = $5,
	attempts = attempts - $6, lease_holder = NULL, lease_until = NULL, updated_at = now(),
	published_at = CASE WHEN $7 THEN NULL ELSE published_at END,
	run_at = CASE WHEN $7 THEN now() + $8 * interval '1 millisecond' ELSE run_at END,
	finished_at = CASE WHEN $3 = 'dead' THEN now() ELSE NULL END,
	payload_summary = CASE WHEN $3 = 'dead' THEN $9 ELSE payload_summary END,
	trace_id = coalesce(nullif($10, ''), trace_id)
	WHERE id = $1 AND status = 'running' AND lease_holder = $2
	RETURNING business_key, coalesce(trace_id, '')`

// maxErrorBytes bounds the error text and summary kept with a job.
const maxErrorBytes = 8 << 10

// storableText makes s fit a Postgres text column: valid UTF-8, no NUL
// bytes (which Postgres refuses), at most max bytes.
func storableText(s string, max int) string {
	if !utf8Valid(s) {
		s = string([]rune(s))
	}
	s = strings.ReplaceAll(s, "\x00", `\0`)
	if len(s) > max {
		cut := max
		for cut > 0 && !utf8.RuneStart(s[cut]) {
			cut--
		}
		s = s[:cut] + " …(truncated)"
	}
	return s
}

func (g *Guard) recordFailure(ctx context.Context, t *asynq.Task, id string, res claimResult, herr error) error {
	ctx = context.WithoutCancel(ctx)
	attempts := res.attempts
	class := g.cfg.Classifier.Classify(herr)
	retried, _ := asynq.GetRetryCount(ctx)
	maxRetry, hasMax := asynq.GetMaxRetry(ctx)
	// asynq archives a task at its own last try; the ledger's count decides
	// the job's budget, because asynq's starts again whenever a job is
	// published anew (a republish after Redis lost data, a wait handed back).
	asynqLastTry := hasMax && retried >= maxRetry
	lastTry := asynqLastTry || attempts-1 >= res.maxRetry
	status := StatusFailed
	uncount := 0
	unpublish := false
	var delay time.Duration
	switch {
	case class == retry.ClassWait:
		// Not a failure: the attempt does not count. On the last asynq try a
		// wait would be archived, so hand the job back to the relay instead.
		status, uncount = StatusPending, 1
		if asynqLastTry {
			unpublish = true
			if e, ok := retry.Marked(herr); ok {
				delay = e.Delay
			}
			herr = fmt.Errorf("%w: %w", herr, asynq.RevokeTask)
		}
	case errors.Is(herr, asynq.SkipRetry) || class == retry.ClassPermanent || lastTry:
		status = StatusDead
	}
	summary := ""
	if status == StatusDead {
		summary = g.cfg.Summarize(t.Type(), t.Payload())
	}
	traceID := TraceID(ctx)
	msg := storableText(herr.Error(), maxErrorBytes)
	summary = storableText(summary, maxErrorBytes)
	var businessKey, storedTrace string
	err := g.store.pool.QueryRow(ctx, failSQL, id, g.cfg.Holder, status, msg, string(class), uncount, unpublish,
		delay.Milliseconds(), summary, traceID).Scan(&businessKey, &storedTrace)
	if errors.Is(err, pgx.ErrNoRows) {
		g.cfg.Logger.Warn("keel: lease lost before failure was recorded", "job_id", id)
		return herr
	}
	if err != nil {
		g.stats.ledgerErrs.Add(1)
		g.cfg.Logger.Error("keel: could not record failure", "job_id", id, "err", err, "handler_err", herr)
		// The row stays running under our lease; it is retried after the lease.
		return herr
	}
	switch status {
	case StatusDead:
		g.stats.dead.Add(1)
		if g.cfg.OnDead != nil {
			g.cfg.OnDead(ctx, DeadEvent{JobID: id, Kind: t.Type(), Queue: queueName(ctx), BusinessKey: businessKey,
				Class: string(class), Error: msg, TraceID: storedTrace, Attempts: attempts})
		}
		if !errors.Is(herr, asynq.SkipRetry) {
			herr = fmt.Errorf("%w: %w", herr, asynq.SkipRetry)
		}
	case StatusFailed:
		g.stats.failed.Add(1)
	}
	return herr
}

func queueName(ctx context.Context) string {
	q, _ := asynq.GetQueueName(ctx)
	return q
}

func taskID(ctx context.Context, t *asynq.Task) string {
	if id, ok := asynq.GetTaskID(ctx); ok {
		return id
	}
	if rw := t.ResultWriter(); rw != nil {
		return rw.TaskID()
	}
	return ""
}

// jobContext travels with a handler's context so Step and InTx know the job.
type jobContext struct {
	guard     *Guard
	id        string
	attempt   int
	completed atomic.Bool
}

type jobKey struct{}

func withJob(ctx context.Context, jc *jobContext) context.Context {
	return context.WithValue(ctx, jobKey{}, jc)
}

func jobFrom(ctx context.Context) (*jobContext, error) {
	jc, ok := ctx.Value(jobKey{}).(*jobContext)
	if !ok {
		return nil, ErrNoJob
	}
	return jc, nil
}

// JobID returns the ledger id of the job a handler is running.
func JobID(ctx context.Context) (string, bool) {
	jc, err := jobFrom(ctx)
	if err != nil {
		return "", false
	}
	return jc.id, true
}

// Attempt returns which attempt (1-based) of the job this run is.
func Attempt(ctx context.Context) int {
	jc, err := jobFrom(ctx)
	if err != nil {
		return 0
	}
	return jc.attempt
}

type traceKey struct{}

// WithTraceID attaches a log/trace id that keel stores with a dead job.
func WithTraceID(ctx context.Context, id string) context.Context {
	return context.WithValue(ctx, traceKey{}, id)
}

// TraceID returns the id set by WithTraceID.
func TraceID(ctx context.Context) string {
	s, _ := ctx.Value(traceKey{}).(string)
	return s
}

// InTx runs fn in a transaction that also marks the current job succeeded:
// the handler's local effects and the completion mark commit together or not
// at all. If this worker has lost the job's lease the transaction is rolled
// back and ErrLeaseLost returned, so a taken-over job never commits twice.
func InTx(ctx context.Context, fn func(tx pgx.Tx) error) error {
	jc, err := jobFrom(ctx)
	if err != nil {
		return err
	}
	if jc.completed.Load() {
		return fmt.Errorf("keel: job %s already completed by an earlier InTx", jc.id)
	}
	g := jc.guard
	tx, err := g.store.pool.Begin(ctx)
	if err != nil {
		return interpretError(err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // no-op after commit
	if err := fn(tx); err != nil {
		return err
	}
	tag, err := tx.Exec(ctx, `UPDATE keel_jobs SET status = 'succeeded', lease_holder = NULL, lease_until = NULL,
		last_error = CASE WHEN error_class = 'wait' THEN NULL ELSE last_error END,
		error_class = CASE WHEN error_class = 'wait' THEN NULL ELSE error_class END,
		finished_at = now(), updated_at = now() WHERE id = $1 AND status = 'running' AND lease_holder = $2`, jc.id, g.cfg.Holder)
	if err != nil {
		return interpretError(err)
	}
	if tag.RowsAffected() == 0 {
		return ErrLeaseLost
	}
	if err := tx.Commit(ctx); err != nil {
		return interpretError(err)
	}
	jc.completed.Store(true)
	return nil
}
