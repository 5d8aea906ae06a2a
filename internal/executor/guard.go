package executor

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/trace"

	"github.com/keeljobs/keel/internal/batch"
	"github.com/keeljobs/keel/internal/jobstore"
	"github.com/keeljobs/keel/internal/ledger"
	"github.com/keeljobs/keel/internal/outcome"
	"github.com/keeljobs/keel/internal/testsignal"
	"github.com/keeljobs/keel/internal/tracing"
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
	// and claims skip locked rows, so a long transaction does not stall it
	// (batch members, whose completions wait for their batch's row, are
	// completed in rounds of their own).
	DefaultBatchLoops   = 1
	completionMarkTries = 4
	// roundTries bounds how often a round Postgres aborted for a lock
	// conflict (deadlock, serialization) runs again at once.
	roundTries  = 3
	busyRecheck = 5 * time.Second
	// DefaultTimeoutGrace is how long a handler may run past its deadline
	// before keel gives its attempt up as failed (class timeout).
	DefaultTimeoutGrace = 5 * time.Second
	// DefaultMaxWait is the ceiling on the total time a job may spend
	// waiting (rate limits, Retry-After) before it dies as waited_too_long.
	DefaultMaxWait = 24 * time.Hour
	// closeWait bounds how long Close waits for outcomes being recorded.
	closeWait = 10 * time.Second
	// callFinishWait bounds how long Close lets steps' calls in flight
	// finish after the shutdown timeout cancelled their runs: with the
	// default 25 s ShutdownTimeout it keeps a deploy inside Kubernetes'
	// default 30 s grace.
	callFinishWait = 4 * time.Second
)

// GuardConfig configures the ledger middleware.
type GuardConfig struct {
	// Holder names this worker in lease rows. Default: host/pid/random.
	Holder string
	// Lease is how long a claim lasts without renewal; it is renewed every
	// Lease/5 while the handler runs (until its deadline), so only a dead
	// worker's lease expires. Default 10s.
	Lease time.Duration
	// LedgerRetry is the longest wait before a task is tried again when the
	// ledger cannot be reached. A delivery waits as long as the outage has
	// lasted so far, at least a second and at most LedgerRetry: a brief
	// outage (a restart, a failover) costs the jobs about as long as it
	// lasted, and a long one does not churn the queues. Such waits do not
	// use up attempts. Default 10s.
	LedgerRetry time.Duration
	// Classifier names the class stored with a failure. Default retry.Default.
	Classifier *retry.Classifier
	// Summarize returns the payload summary stored with a dead job; it is where
	// secrets are redacted. Default: the payload's first 512 bytes as text.
	Summarize func(kind string, payload []byte) string
	// OnDead is called after a job is marked dead (alerts hook in here).
	// Left nil, server.New logs each death at Error level ("keel: job
	// died"); one set here replaces that line (alert.Alerter.JobDied logs it
	// too). A death is alerted at least once: if the worker is killed
	// before OnDead returns, a reconciler calls it Grace later (the ledger
	// keeps the alert owed until it returns), so one killed midway may see
	// a death twice.
	OnDead func(ctx context.Context, j jobstore.DeadEvent)
	// OnExpired is called when the guard discards a job whose deadline
	// passed before it could run, its kind dropping stale work
	// (tasks.ExpireAtDeadline): the event's Class is expired. Metrics hook
	// in here; such a job raises no alert.
	OnExpired func(ctx context.Context, j jobstore.DeadEvent)
	// OnCancelled is called when the guard stops a run because its job was
	// cancelled (metrics hook in here).
	OnCancelled func(ctx context.Context, j CancelEvent)
	// Logger; default slog.Default().
	Logger *slog.Logger
	// BatchSize bounds how many claims or completions share one statement.
	// Default 128.
	BatchSize int
	// TimeoutGrace is how long a handler may outlive its deadline (the
	// kind's timeout; asynq's 30 minutes when none) before the guard stops
	// renewing its lease and records the attempt as failed with class
	// timeout. Whatever the goroutine does later cannot commit: its InTx and
	// Step are refused. Default 5s.
	TimeoutGrace time.Duration
	// MaxWait is the ceiling on the total time a job spends in waits
	// (retry.Wait: rate limits, Retry-After) for jobs whose kind sets none
	// (tasks.MaxWait). Past it the job dies with class waited_too_long.
	// Default 24h.
	MaxWait time.Duration
	// ProgressInterval is the least time between two writes of one run's
	// progress (idempotency.Progress): reports in between are kept in
	// memory and the latest is written when the interval is up. Default 1s.
	ProgressInterval time.Duration
	// TracerProvider records the keel.handle, keel.claim, keel.step and
	// keel.intx spans of each run. Default: the global provider
	// (otel.GetTracerProvider); while that is the no-op, no span is started.
	TracerProvider trace.TracerProvider

	// signals are off unless a test turns them on (export_test.go); they
	// ride in the config so they are on before NewGuard starts renewing.
	signals testSignals
}

// testSignals tell tests what the guard's background work did, so they
// wait on it rather than on the clock; off in production.
type testSignals struct {
	// Renewed is each tick of the renew loop that had runs to renew, sent
	// once it is over.
	Renewed testsignal.Signal[renewal]
	// Overran is the id of each run the watchdog found past its deadline
	// and grace, sent once it was given up (or, its completing InTx
	// committed, let go).
	Overran testsignal.Signal[string]
	// Busy is the id of each delivery that found another run holding its
	// job's lease, sent before it is put back to wait.
	Busy testsignal.Signal[string]
	// Skipped is the id of each delivery acknowledged without a run, its
	// job having ended.
	Skipped testsignal.Signal[string]
	// LateClaim is the id of each delivery that stopped waiting for its
	// claim (counted in GuardStats.LateClaims).
	LateClaim testsignal.Signal[string]
	// made, when set, is handed the guard NewGuard made, for a test that
	// reaches into a worker's guard.
	made func(*Guard)
}

// renewal is one tick of the renew loop, as testSignals report it.
type renewal struct {
	// Began is when the tick began: a lease it renewed was renewed after.
	Began time.Time
	// Renewed are the ids of the runs whose leases it renewed.
	Renewed []string
}

// CancelEvent describes a run the guard stopped because its job was
// cancelled.
type CancelEvent struct {
	JobID, Kind, Queue string
	Attempt            int
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
	if c.TimeoutGrace <= 0 {
		c.TimeoutGrace = DefaultTimeoutGrace
	}
	if c.MaxWait <= 0 {
		c.MaxWait = DefaultMaxWait
	}
	if c.ProgressInterval <= 0 {
		c.ProgressInterval = DefaultProgressInterval
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

// summarize is the kind's Summarize, which is the application's code: one
// that panics must not stop the guard recording a death (the panic would
// leave the job running, to be run, fail and panic again for ever). Its
// summary is then a note, not the payload it was there to redact.
func (g *Guard) summarize(t *asynq.Task) (s string) {
	defer func() {
		if p := recover(); p != nil {
			g.cfg.Logger.Error("keel: the payload summary panicked; the dead job keeps a note instead", "kind", t.Type(), "panic", p)
			s = fmt.Sprintf("(no summary: the kind's Summary panicked: %v)", p)
		}
	}()
	return g.cfg.Summarize(t.Type(), t.Payload())
}

// onDead and onCancelled run the application's hooks. One that panics is
// logged, not let loose on the goroutine that called it: a handler's, whose
// recorded death the panic would turn into a delivery asynq retries, or the
// lease renewal's, which it would take down with the worker and every run
// on it.
func (g *Guard) onDead(ctx context.Context, e jobstore.DeadEvent) {
	defer g.recoverHook("OnDead", e.JobID)
	g.cfg.OnDead(ctx, e)
}

// died runs the OnDead hook for a death the ledger has recorded, then
// records its alert paid. A worker killed in between leaves the alert owed
// in the ledger, and a reconciler runs the hook for it: a death is alerted
// at least once.
func (g *Guard) died(ctx context.Context, e jobstore.DeadEvent) {
	if g.cfg.OnDead != nil {
		g.onDead(ctx, e)
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	if err := g.store.AlertsPaid(ctx, e.JobID); err != nil {
		g.stats.ledgerErrs.Add(1)
		g.cfg.Logger.Warn("keel: could not record a death's alert as sent; a reconciler sends it again", "job_id", e.JobID, "err", err)
	}
}

func (g *Guard) onCancelled(e CancelEvent) {
	defer g.recoverHook("OnCancelled", e.JobID)
	g.cfg.OnCancelled(context.Background(), e)
}

func (g *Guard) recoverHook(name, jobID string) {
	if p := recover(); p != nil {
		g.cfg.Logger.Error("keel: the guard's "+name+" hook panicked", "job_id", jobID, "panic", p, "stack", string(debug.Stack()))
	}
}

// GuardStats are counters since the guard started.
type GuardStats struct {
	Claimed, Succeeded, Failed, Dead, DuplicatesSkipped, LeaseBusy, LedgerErrors uint64
	// RenewalsMissed counts ticks of the renew loop whose renewal failed or
	// found no connection within a third of the lease (also in
	// LedgerErrors); the next tick renews the same leases, well before
	// they run out.
	RenewalsMissed uint64
	// Overran counts handlers that outlived their deadline and grace.
	Overran uint64
	// Interrupted counts runs cut short by shutdown (not counted as attempts).
	Interrupted uint64
	// Crashed counts jobs retired because their runs kept ending without
	// an outcome (poison jobs).
	Crashed uint64
	// Cancelled counts runs stopped because their job was cancelled.
	Cancelled uint64
	// Expired counts jobs discarded at their deadline before they could
	// run (tasks.ExpireAtDeadline); those that died there count in Dead.
	Expired uint64
	// ProgressWrites counts the progress writes sent to the ledger, those
	// it refused included (idempotency.Progress).
	ProgressWrites uint64
	// LateClaims counts deliveries whose claim was not answered before
	// the delivery's own deadline: the job was handed back unstarted, to
	// run at a delivery soon after (a slow ledger, not a refusing one).
	LateClaims uint64
	// Held counts deliveries acknowledged unrun because their job's kind
	// or queue is paused in the ledger (which holds the job until the
	// pause ends).
	Held uint64
	// HungHandlers is how many handlers keel gave up (timed out, cancelled,
	// interrupted, their lease lost) still run on this worker, ignoring
	// their context: each holds a goroutine and whatever it took, and a
	// crashed job's last run, which must run alone, is handed to other
	// workers while one goes on. Only a restart of the worker ends a
	// handler that never returns.
	HungHandlers int
}

// Guard is the ledger middleware: it claims each delivery's job with a lease
// before the handler runs, acknowledges deliveries of finished jobs without
// running anything, and moves the row along the state machine afterwards.
type Guard struct {
	store *jobstore.Store
	cfg   GuardConfig

	ledger *batch.Batcher[ledgerReq] // claims and completions, in shared rounds
	// members completes batch members, in rounds of their own for each
	// batch: each waits for its batch's row, which a producer adding
	// members holds until it commits, and neither claims nor other
	// batches' members must wait with it.
	members *memberRounds

	mu      sync.Mutex
	running map[*jobContext]struct{}
	// stopping is set when the worker begins to shut down: a handler whose
	// context is cancelled from then on was interrupted, not failed.
	stopping atomic.Bool

	stats struct {
		claimed, succeeded, failed, dead, skipped, busy, ledgerErrs, renewalsMissed atomic.Uint64
		overran, interrupted, crashed, cancelled, expired                           atomic.Uint64
		progressWrites, lateClaims, held                                            atomic.Uint64
	}

	stopRenew context.CancelFunc
	renewDone chan struct{}
	closeOnce sync.Once

	// recording counts deliveries between their claim and their recorded
	// outcome (outside the handler itself): Close waits for them, so that
	// a shutdown does not cut a completion mark and leave a finished job
	// looking crashed.
	recording phases
	// calls counts steps' calls in flight: Close lets them finish (up to
	// callFinishWait) before it gives their runs up, since a call cut off
	// leaves its step in doubt.
	calls phases

	// inFlight are the steps' calls in flight on this worker (flight.go).
	inFlight flights

	// A test hook of this guard, nil outside tests: the moment between an
	// InTx's commit and its run noting it.
	inTxCommittedHook atomic.Pointer[func(jobID string)]
	// strays are the given-up handlers still running here (stray.go).
	strays strays

	tracer tracing.Tracer // the spans of each run (trace.go)
	gate   *aloneGate     // lets a job's last run after a crash run alone (alone.go)

	// outageSince is when the ledger was first found unreachable (unix
	// nanoseconds), 0 while it answers: ledgerWait grows with the outage.
	outageSince atomic.Int64
}

// minLedgerWait is the first wait of a delivery the ledger could not take.
const minLedgerWait = time.Second

// ledgerWait is how long a delivery the ledger could not take waits: as
// long as the outage has lasted, within [minLedgerWait, LedgerRetry]. An
// error that is no outage (a statement refused, a context ended) waits
// LedgerRetry and starts no outage clock.
func (g *Guard) ledgerWait(err error) time.Duration {
	if !errors.Is(err, jobstore.ErrLedgerUnavailable) && !ledgerUnreachable(err) {
		return g.cfg.LedgerRetry
	}
	now := time.Now().UnixNano()
	g.outageSince.CompareAndSwap(0, now) // the first refusal starts the clock
	since := g.outageSince.Load()
	if since == 0 { // the ledger answered meanwhile
		since = now
	}
	return min(max(time.Duration(now-since), minLedgerWait), g.cfg.LedgerRetry)
}

// ledgerAnswered ends the outage ledgerWait measures.
func (g *Guard) ledgerAnswered() {
	if g.outageSince.Load() != 0 {
		g.outageSince.Store(0)
	}
}

// phases counts work in progress that Close must let finish.
type phases struct {
	mu     sync.Mutex
	n      int
	closed bool
	zero   chan struct{}
}

// enter starts a phase; it fails once closing began, unless force.
func (p *phases) enter(force bool) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed && !force {
		return false
	}
	p.n++
	return true
}

func (p *phases) leave() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.n--; p.n == 0 && p.zero != nil {
		close(p.zero)
		p.zero = nil
	}
}

// closeAndWait refuses new phases and waits up to timeout for the rest.
func (p *phases) closeAndWait(timeout time.Duration) {
	p.mu.Lock()
	p.closed = true
	if p.n == 0 {
		p.mu.Unlock()
		return
	}
	z := make(chan struct{})
	p.zero = z
	p.mu.Unlock()
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case <-z:
	case <-t.C:
	}
}

// NewGuard starts a guard on store. Close it after the server has stopped.
func NewGuard(store *jobstore.Store, cfg GuardConfig) *Guard {
	cfg = cfg.withDefaults()
	g := &Guard{store: store, cfg: cfg, running: map[*jobContext]struct{}{}, renewDone: make(chan struct{}), gate: newAloneGate()}
	g.tracer = tracing.New(cfg.TracerProvider)
	g.ledger = batch.New(DefaultBatchLoops, cfg.BatchSize, ErrGuardClosed, g.runRound)
	g.members = &memberRounds{open: map[string]*memberBatch{}, size: cfg.BatchSize, run: g.runRound}
	ctx, cancel := context.WithCancel(context.Background())
	g.stopRenew = cancel
	go g.renewLoop(ctx)
	if cfg.signals.made != nil {
		cfg.signals.made(g)
	}
	return g
}

// Holder is the name this guard writes into lease rows.
func (g *Guard) Holder() string { return g.cfg.Holder }

// Stats returns the guard's counters.
func (g *Guard) Stats() GuardStats {
	return GuardStats{
		Claimed: g.stats.claimed.Load(), Succeeded: g.stats.succeeded.Load(), Failed: g.stats.failed.Load(),
		Dead: g.stats.dead.Load(), DuplicatesSkipped: g.stats.skipped.Load(), LeaseBusy: g.stats.busy.Load(),
		LedgerErrors: g.stats.ledgerErrs.Load(), RenewalsMissed: g.stats.renewalsMissed.Load(), Overran: g.stats.overran.Load(),
		Interrupted: g.stats.interrupted.Load(), Crashed: g.stats.crashed.Load(), Cancelled: g.stats.cancelled.Load(),
		Expired: g.stats.expired.Load(), ProgressWrites: g.stats.progressWrites.Load(), LateClaims: g.stats.lateClaims.Load(),
		Held: g.stats.held.Load(), HungHandlers: g.gate.hung(),
	}
}

// BeginShutdown tells the guard the worker is stopping: from now on a run
// whose context is cancelled was interrupted by the deploy, so it does not
// count as an attempt and its lease is released at once. The server calls
// it before it stops asynq.
func (g *Guard) BeginShutdown() {
	g.stopping.Store(true)
	g.gate.close()
}

// Close stops the guard's background loops. Runs still going (handlers that
// ignored their cancelled context) are given up as interrupted: their
// leases are released so that another worker starts them within seconds,
// and nothing they do later can commit.
func (g *Guard) Close() {
	g.closeOnce.Do(func() {
		g.stopping.Store(true)
		g.gate.close()
		// Runs outside a step's call are given up at once; those inside
		// one get callFinishWait to finish it and record its answer, their
		// leases renewed meanwhile, and are given up then.
		g.giveUpLive(func(jc *jobContext) bool { return jc.inCall.Load() == 0 })
		g.calls.closeAndWait(callFinishWait)
		g.stopRenew()
		<-g.renewDone
		g.giveUpLive(func(*jobContext) bool { return true })
		g.recording.closeAndWait(closeWait)
		g.ledger.Close()
		g.members.Close()
	})
}

// giveUpLive gives up the live runs which: interrupted, their leases
// released so that another worker starts them within seconds, and nothing
// they do later can commit.
func (g *Guard) giveUpLive(which func(*jobContext) bool) {
	g.mu.Lock()
	left := make([]*jobContext, 0, len(g.running))
	for jc := range g.running {
		if which(jc) {
			left = append(left, jc)
		}
	}
	g.mu.Unlock()
	for _, jc := range left {
		if jc.state.CompareAndSwap(runLive, runInterrupted) {
			g.untrack(jc)
			jc.cancel(ErrGuardClosed)
			jc.dropTx()
			g.release(context.Background(), jc)
		}
	}
}

type claimOutcome int

const (
	claimed claimOutcome = iota
	claimFinished
	claimDead
	claimBusy
	claimMissing
	// claimExhausted: the job is claimable but its budget is used up by
	// runs that ended without an outcome; it must retire, not run.
	claimExhausted
	// claimHeld: the job's kind or queue is paused in the ledger; the
	// ledger holds the job until the pause ends, and the delivery is
	// acknowledged unrun.
	claimHeld
)

type claimResult struct {
	outcome    claimOutcome
	attempts   int
	run        int    // the run's number: with the holder, its identity
	alone      bool   // it must run alone on this worker (the job's last run, after a crash)
	batchID    string // the job's batch, if it is a member: its completion moves the batch's counters
	maxRetry   int
	waited     time.Duration
	maxWait    time.Duration
	leaseUntil time.Time
	deadline   *time.Time // the job's, if it has one: a retry past it never runs
	status     Status
	err        error
}

// ledgerReq is one claim or one completion waiting for the next round.
type ledgerReq struct {
	id       string
	run      int // completions: the run's number, so a stale run cannot complete
	complete bool
	inBatch  bool             // completions: a batch member's (roundBatchSQL)
	claimOut chan claimResult // claims
	doneOut  chan error       // completions
}

// runRound runs one round of waiting claims and completions: one statement
// in the common case, a second one only for claims that did not succeed.
func (g *Guard) runRound(ctx context.Context, reqs []ledgerReq) {
	// Sized for the round at once: a round is built for every few jobs.
	doneIDs := make([]string, 0, len(reqs))
	doneRuns := make([]int32, 0, len(reqs))
	completing := make(map[string]bool, len(reqs))
	batch := false
	for _, r := range reqs {
		if r.complete {
			doneIDs = append(doneIDs, r.id)
			doneRuns = append(doneRuns, int32(r.run))
			completing[r.id] = true
			if r.inBatch {
				batch = true
			}
		}
	}
	// A claim of a job this worker is completing in this very round is a
	// duplicate delivery of a job it holds: busy (the next look finds it
	// finished). Every other id is claimed once; later copies are busy.
	claimIDs := make([]string, 0, len(reqs)-len(doneIDs))
	asked := make(map[string]bool, len(reqs)-len(doneIDs))
	for _, r := range reqs {
		if !r.complete && !completing[r.id] && !asked[r.id] {
			claimIDs = append(claimIDs, r.id)
			asked[r.id] = true
		}
	}
	var results map[string]claimResult
	var done map[string]bool
	var err error
	// An aborted round changed nothing: it runs again as it was.
	for try := 1; ; try++ {
		results, done, err = g.round(ctx, ledger.RoundArgs{Holder: g.cfg.Holder, LeaseMS: g.cfg.Lease.Milliseconds(),
			Claim: claimIDs, Done: doneIDs, DoneRuns: doneRuns, Batch: batch}, completing)
		if err == nil || try == roundTries || !lockConflict(err) {
			break
		}
		g.cfg.Logger.Warn("keel: ledger round aborted by a lock conflict; running it again", "err", err)
	}
	// The round committed: a failure to read why some claims did not take
	// concerns only those claims.
	var explainErr error
	if err == nil && len(results) < len(claimIDs) {
		explainErr = g.explainUnclaimed(ctx, claimIDs, results)
	}
	busy := claimResult{outcome: claimBusy, status: ledger.StatusRunning, leaseUntil: time.Now().Add(g.cfg.Lease)}
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

// round runs the round's statement once: the claims it made, the
// completions it marked.
func (g *Guard) round(ctx context.Context, a ledger.RoundArgs, completing map[string]bool) (map[string]claimResult, map[string]bool, error) {
	results := make(map[string]claimResult, len(a.Claim))
	done := make(map[string]bool, len(a.Done))
	err := ledger.Round(ctx, g.store.Pool(), a, func(c ledger.Claimed) {
		if completing[c.ID] {
			done[c.ID] = true
			return
		}
		results[c.ID] = claimResult{outcome: claimed, attempts: c.Attempts, run: c.Run, alone: c.Alone, maxRetry: c.Budget, status: ledger.StatusRunning,
			waited: time.Duration(c.WaitedMS) * time.Millisecond, maxWait: time.Duration(c.MaxWaitMS) * time.Millisecond,
			batchID: c.BatchID, deadline: c.Deadline}
	})
	if err != nil {
		return nil, nil, err
	}
	return results, done, nil
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
	return ledger.ReadUnclaimed(ctx, g.store.Pool(), rest, func(u ledger.Unclaimed) {
		res := claimResult{status: u.Status, attempts: u.Attempts, leaseUntil: u.LeaseUntil}
		switch {
		case u.Exhausted:
			res.outcome = claimExhausted
		case res.status == ledger.StatusPaused:
			res.outcome = claimHeld
		case res.status.Terminal():
			res.outcome = claimFinished
		case res.status == ledger.StatusDead:
			res.outcome = claimDead
		default:
			res.outcome = claimBusy
		}
		results[u.ID] = res
	})
}

// A claim's and a completion's answers come on channels of one slot that a
// round sends on exactly once. A channel goes back to its pool only once
// its answer has been received (or its request was never queued): one left
// behind for a late answer is never reused.
var (
	claimOuts = sync.Pool{New: func() any { return make(chan claimResult, 1) }}
	doneOuts  = sync.Pool{New: func() any { return make(chan error, 1) }}
)

func (g *Guard) claim(ctx context.Context, id string) claimResult {
	out := claimOuts.Get().(chan claimResult)
	if err := g.ledger.Submit(ctx, ledgerReq{id: id, claimOut: out}); err != nil {
		claimOuts.Put(out)
		return claimResult{err: err}
	}
	select {
	case res := <-out:
		claimOuts.Put(out)
		return res
	case <-ctx.Done():
		// The claim may still land after the delivery gave up on it: give
		// it back then, or its expired lease would later count as a crash
		// of a run that never started.
		go g.undoLateClaim(id, out)
		return claimResult{err: ctx.Err()}
	case <-g.ledger.Closed():
		return claimResult{err: ErrGuardClosed}
	}
}

// undoLateClaim waits for the result of a claim nobody waits for any more
// and releases the job if the claim took.
func (g *Guard) undoLateClaim(id string, out <-chan claimResult) {
	select {
	case res := <-out:
		if res.outcome == claimed && res.err == nil {
			g.release(context.Background(), &jobContext{id: id, attempt: res.attempts, run: res.run})
		}
	case <-g.ledger.Closed():
	}
}

func (g *Guard) complete(ctx context.Context, jc *jobContext) error {
	b := g.ledger
	if jc.batchID != "" {
		var err error
		if b, err = g.members.acquire(jc.batchID); err != nil {
			return err
		}
		defer g.members.release(jc.batchID)
	}
	out := doneOuts.Get().(chan error)
	if err := b.Submit(ctx, ledgerReq{id: jc.id, run: jc.run, inBatch: jc.batchID != "", complete: true, doneOut: out}); err != nil {
		doneOuts.Put(out)
		return err
	}
	select {
	case err := <-out:
		doneOuts.Put(out)
		return err
	case <-ctx.Done():
		return ctx.Err()
	case <-b.Closed():
		return ErrGuardClosed
	}
}

func (g *Guard) track(jc *jobContext) {
	g.mu.Lock()
	g.running[jc] = struct{}{}
	g.mu.Unlock()
}

// stopRenewing ends jc's renewals: its run ended and its outcome is
// recorded.
func (g *Guard) stopRenewing(jc *jobContext) {
	g.mu.Lock()
	delete(g.running, jc)
	g.mu.Unlock()
}

// untrack ends the renewals of a run keel gives up. It no longer holds up
// a run that waits to run alone (its handler may hang for ever), but is
// known to the gate until it returns.
func (g *Guard) untrack(jc *jobContext) {
	g.stopRenewing(jc)
	jc.pass.giveUp()
}

// renewLoop extends the leases of every job this worker is running, in one
// statement, so that only a dead worker's lease ever expires.
func (g *Guard) renewLoop(ctx context.Context) {
	defer close(g.renewDone)
	t := time.NewTicker(g.cfg.Lease / 5)
	defer t.Stop()
	var began time.Time
	for {
		select {
		case <-ctx.Done():
			return
		case began = <-t.C:
		}
		renewed, looked := g.renewRunning(ctx)
		g.renewFlights(ctx)
		g.renewStrays(ctx)
		if looked {
			g.cfg.signals.Renewed.Signal(renewal{Began: began, Renewed: renewed})
		}
	}
}

// renewRunning renews the leases of the runs in progress and stops those
// that lost theirs. It returns the ids it renewed, and whether there were
// runs to renew.
func (g *Guard) renewRunning(ctx context.Context) (renewed []string, looked bool) {
	g.mu.Lock()
	jcs := make([]*jobContext, 0, len(g.running))
	ids := make([]string, 0, len(g.running))
	runs := make([]int32, 0, len(g.running))
	for jc := range g.running {
		if jc.completed.Load() {
			continue // its InTx ended the lease
		}
		jcs = append(jcs, jc)
		ids = append(ids, jc.id)
		runs = append(runs, int32(jc.run))
	}
	g.mu.Unlock()
	if len(ids) == 0 {
		return nil, false
	}
	rctx, cancel := context.WithTimeout(ctx, g.cfg.Lease/3)
	renewed, err := g.renew(rctx, ids, runs)
	cancel()
	if err != nil {
		if ctx.Err() == nil {
			g.stats.ledgerErrs.Add(1)
			g.stats.renewalsMissed.Add(1)
			g.cfg.Logger.Warn("keel: lease renewal failed", "jobs", len(ids), "err", err)
		}
		return nil, true
	}
	kept := make(map[string]bool, len(renewed))
	for _, id := range renewed {
		kept[id] = true
	}
	var lost []*jobContext
	for _, jc := range jcs {
		if !kept[jc.id] && !jc.completed.Load() && jc.state.Load() == runLive {
			lost = append(lost, jc)
		}
	}
	if len(lost) > 0 {
		fates, err := g.leaseFates(ctx, lost)
		if err != nil {
			// Look again at the next renewal; meanwhile the run can
			// commit nothing without its lease.
			if ctx.Err() == nil {
				g.cfg.Logger.Warn("keel: could not read the jobs whose lease renewal failed", "jobs", len(lost), "err", err)
			}
			lost = nil
		}
		for _, jc := range lost {
			switch fates[jc] {
			case fateCancelled:
				// Stopped here even if asynq's cancel message never
				// reached this worker.
				g.stopCancelled(jc)
			case fateLost:
				// Another worker took the job over (this one missed its
				// renewals): stop the handler, nothing it does can
				// commit any more.
				g.cfg.Logger.Warn("keel: lease lost while the handler ran; cancelling it", "job_id", jc.id)
				jc.cancel(ErrLeaseLost)
				// It is no run of the job's any more; if it ignores the
				// cancel it is a hung handler to the gate.
				jc.pass.giveUp()
			}
		}
	}
	return renewed, true
}

// renew extends the leases of the runs ids (with their run numbers) and
// returns the ids still theirs (renewSQL).
func (g *Guard) renew(ctx context.Context, ids []string, runs []int32) ([]string, error) {
	return ledger.Renew(ctx, g.store.Pool(), g.cfg.Holder, g.cfg.Lease.Milliseconds(), ids, runs)
}

// Middleware returns the asynq middleware. Install it before the handler and
// after panic recovery and logging.
func (g *Guard) Middleware(next asynq.Handler) asynq.Handler {
	return g.traceHandle(asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
		id := taskID(ctx, t)
		if ledger.ValidateKey("task id", id) != nil {
			// Not a ledger id, and one Postgres cannot even hold: it must not
			// share (and fail) a round with the others.
			return fmt.Errorf("%w: task id %q: %w", ErrUnknownJob, id, asynq.SkipRetry)
		}
		// Deliveries wait here while a run runs alone on this worker.
		pass, err := g.gate.enterAs(ctx, id, gateWait(ctx, holdWait))
		if err != nil {
			why := "another job runs alone on this worker"
			if errors.Is(err, ErrGuardClosed) {
				why = "worker shutting down"
			}
			return keepQueued(ctx, retry.Wait(time.Second, fmt.Errorf("keel: job %s not started: %s: %w", id, why, err)))
		}
		defer pass.leave()
		if !g.recording.enter(false) {
			// Another worker takes it: the wait only puts it back.
			return retry.Wait(minLedgerWait, fmt.Errorf("keel: worker shutting down, job %s not started: %w", id, ErrGuardClosed))
		}
		res := g.tracedClaim(ctx, id)
		g.recording.leave()
		if res.err != nil && ctx.Err() != nil && errors.Is(res.err, ctx.Err()) {
			// The delivery's deadline (its kind's timeout) passed while its
			// claim waited for a busy ledger or pool: the ledger answered
			// late, it did not refuse. The claim is given back when it lands
			// (undoLateClaim); the next delivery comes as soon as an outage
			// would allow, not after LedgerRetry.
			g.stats.lateClaims.Add(1)
			g.cfg.signals.LateClaim.Signal(id)
			return keepQueued(ctx, retry.Wait(g.ledgerWait(jobstore.ErrLedgerUnavailable),
				fmt.Errorf("keel: job %s not started: its claim was not answered before the delivery's deadline: %w", id, res.err)))
		}
		if res.err != nil {
			g.stats.ledgerErrs.Add(1)
			return keepQueued(ctx, retry.Wait(g.ledgerWait(res.err), fmt.Errorf("keel: ledger unavailable, job %s not started: %w", id, res.err)))
		}
		g.ledgerAnswered()
		switch res.outcome {
		case claimFinished, claimDead:
			g.stats.skipped.Add(1)
			outcome.Note(ctx, outcome.Duplicate)
			g.cfg.Logger.Debug("keel: duplicate delivery acknowledged", "job_id", id, "status", res.status)
			g.cfg.signals.Skipped.Signal(id)
			return nil
		case claimBusy:
			g.stats.busy.Add(1)
			g.cfg.signals.Busy.Signal(id)
			// Look again soon: the holder usually finishes well before its
			// lease ends, and a dead holder's lease ends on its own.
			wait := min(time.Until(res.leaseUntil)+time.Second, busyRecheck)
			return keepQueued(ctx, retry.Wait(max(wait, time.Second), ErrLeaseHeld))
		case claimMissing:
			return fmt.Errorf("%w: job %s: %w", ErrUnknownJob, id, asynq.SkipRetry)
		case claimExhausted:
			return g.retireCrashed(ctx, t, id)
		case claimHeld:
			// The resume hands the job to the relay, which publishes it
			// anew: this copy goes, so a paused job costs no delivery.
			g.stats.held.Add(1)
			outcome.Note(ctx, outcome.Held)
			g.cfg.signals.Skipped.Signal(id)
			return nil
		}
		g.stats.claimed.Add(1)

		jc := &jobContext{guard: g, id: id, attempt: res.attempts, run: res.run, batchID: res.batchID, kind: t.Type(),
			queue: queueName(ctx), pass: pass}
		noteRun(ctx, jc)
		hctx, cancel := context.WithCancelCause(withJob(ctx, jc))
		defer cancel(nil)
		// ended carries keel's own reasons to stop the run (lease lost,
		// given up, cancelled, closed), not asynq's: a step's call in
		// flight outlives a deploy's cancellation but not these.
		ended, endRun := context.WithCancelCause(context.Background())
		defer endRun(nil)
		jc.ended = ended
		jc.cancel = func(cause error) { cancel(cause); endRun(cause) }
		g.track(jc)
		var watchdog *time.Timer
		if deadline, ok := ctx.Deadline(); ok {
			watchdog = time.AfterFunc(time.Until(deadline)+g.cfg.TimeoutGrace, func() { g.overran(ctx, t, jc, res, deadline) })
		}
		var herr error
		if res.alone {
			herr = g.runAlone(hctx, jc, res)
		}
		if herr == nil {
			herr = next.ProcessTask(retry.WithRetried(hctx, res.attempts-1), t)
		}
		if watchdog != nil {
			watchdog.Stop()
		}
		// A report not yet written is dropped; one being written lands
		// before the outcome is recorded.
		jc.progress.end()
		// Entered before the state changes, so that Close, which gives up
		// live runs first and then waits, either sees this one live or
		// waits for its outcome.
		g.recording.enter(true)
		defer g.recording.leave()
		if !jc.state.CompareAndSwap(runLive, runReturned) {
			if g.strays.has(jc.id) && jc.state.Load() != runInterrupted {
				g.strayReturned(jc)
			}
			if jc.state.Load() == runCancelled {
				// Recorded by the person who cancelled it: acknowledged, no
				// retry, no dead letter.
				g.cfg.Logger.Info("keel: cancelled job's handler returned", "job_id", id, "attempt", res.attempts, "err", herr)
				outcome.Note(ctx, outcome.Cancelled)
				return nil
			}
			if jc.state.Load() == runInterrupted {
				// The worker's Close gave the run back (released, the
				// attempt not counted) before its handler returned: a
				// deploy, not a failure, however late the handler noticed.
				g.cfg.Logger.Info("keel: handler returned after the worker's shutdown gave its run back; its result is ignored",
					"job_id", id, "attempt", res.attempts, "err", herr)
				outcome.Note(ctx, outcome.Interrupted)
				if herr == nil {
					herr = ErrGuardClosed
				}
				return herr
			}
			// The watchdog gave this run up and recorded its outcome;
			// asynq moved on long ago.
			g.cfg.Logger.Warn("keel: handler returned after keel gave its run up; its result is ignored",
				"job_id", id, "attempt", res.attempts, "err", herr)
			if herr == nil {
				herr = ErrRunGivenUp
			}
			outcome.Note(ctx, outcome.GivenUp)
			return herr
		}
		// Renewed until its outcome is recorded: a completion mark that
		// takes a few tries must not let the lease expire into a "crash".
		// Its place at the gate is kept as long (pass.leave, deferred
		// above): a run recorded as alone whose outcome is not written yet
		// is still running in the ledger, and a crash beside it now would
		// be taken for its own.
		defer g.stopRenewing(jc)

		if jc.completed.Load() {
			// InTx committed the job's completion. One rule, however late
			// the handler returns: an error of its own after that is a dead
			// letter (what it counted on after the commit did not happen);
			// a run asynq cut short (a deploy's shutdown, its lease lost in
			// a Redis outage) is a success, its effects being in.
			if herr != nil && !errors.Is(ctx.Err(), context.Canceled) {
				return g.failedAfterComplete(ctx, t, jc, herr)
			}
			if herr != nil {
				g.cfg.Logger.Info("keel: run cut short after its completing InTx committed; the job succeeded",
					"job_id", id, "err", herr)
			}
			g.stats.succeeded.Add(1)
			return nil
		}
		if herr != nil && errors.Is(ctx.Err(), context.Canceled) {
			if !g.stopping.Load() && g.cancelledLate(ctx, jc) {
				return nil
			}
			// asynq cut the run short: the deploy's shutdown, or asynq's task
			// lease ran out because Redis was unreachable for its 30 s (asynq
			// then cancels every run it holds, though the ledger's lease
			// held). Neither is the job's failure. asynq puts the task back,
			// or its recoverer and keel's reconciler do; the lease goes at
			// once so the next worker can start.
			g.stats.interrupted.Add(1)
			jc.state.Store(runInterrupted)
			g.release(ctx, jc)
			outcome.Note(ctx, outcome.Interrupted)
			return herr
		}
		if herr == nil {
			return g.markSucceeded(ctx, jc)
		}
		class := g.cfg.Classifier.Classify(herr)
		if class == retry.ClassWait && errors.Is(herr, jobstore.ErrLedgerUnavailable) {
			herr = retry.Wait(g.ledgerWait(herr), herr)
		}
		if errors.Is(ctx.Err(), context.DeadlineExceeded) && class != retry.ClassPermanent && class != retry.ClassWait {
			class = retry.ClassTimeout
		}
		return g.recordFailure(ctx, t, jc, res, herr, class)
	}))
}

// keepQueued makes sure a wait at asynq's last try is not archived: asynq
// archives whatever fails then, waits included. The task is revoked instead;
// the ledger still has the job open, so the holder's run, the rescuer or
// the reconciler brings it back.
func keepQueued(ctx context.Context, err error) error {
	if asynqLastTry(ctx) {
		return fmt.Errorf("%w: %w", err, asynq.RevokeTask)
	}
	return err
}

func asynqLastTry(ctx context.Context) bool {
	retried, _ := asynq.GetRetryCount(ctx)
	maxRetry, ok := asynq.GetMaxRetry(ctx)
	return ok && retried >= maxRetry
}

// release gives an interrupted run's job back: pending again, the attempt
// not counted, no lease, so the next delivery anywhere starts it at once.
func (g *Guard) release(ctx context.Context, jc *jobContext) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	err := ledger.Release(ctx, g.store.Pool(), jc.id, g.cfg.Holder, jc.run)
	if err != nil {
		g.stats.ledgerErrs.Add(1)
		g.cfg.Logger.Warn("keel: could not release an interrupted job; its lease expires on its own", "job_id", jc.id, "err", err)
		return
	}
	g.cfg.Logger.Info("keel: run interrupted by shutdown; job released, attempt not counted", "job_id", jc.id)
}

// overran gives up a run whose handler outlived its deadline and grace: the
// lease is no longer renewed, the attempt counts as failed (class timeout)
// and the job retries or dies by its budget.
func (g *Guard) overran(ctx context.Context, t *asynq.Task, jc *jobContext, res claimResult, deadline time.Time) {
	if jc.completed.Load() {
		// Its completing InTx committed: there is no attempt left to fail.
		// The run stays this guard's, so that an error it returns later is
		// a dead letter as it would be before the deadline; it no longer
		// holds up a run that waits to run alone.
		g.stopRenewing(jc)
		jc.pass.giveUp()
		g.stats.overran.Add(1)
		g.cfg.Logger.Warn("keel: handler outlived its timeout after its completing InTx committed; an error it returns is still recorded",
			"job_id", jc.id, "kind", t.Type(), "deadline", deadline)
		g.cfg.signals.Overran.Signal(jc.id)
		return
	}
	if !jc.state.CompareAndSwap(runLive, runAbandoned) {
		return
	}
	g.untrack(jc)
	jc.cancel(ErrRunGivenUp)
	// A handler hung inside InTx holds a pool connection for as long as it
	// hangs: a few such runs would leave the guard no connection to record
	// anything with, this timeout included. So its connection goes first.
	jc.dropTx()
	// Before the outcome: a death frees the job's key for a newer job,
	// which must not start while this handler may still act.
	g.markStray(jc)
	g.stats.overran.Add(1)
	g.cfg.Logger.Warn("keel: handler outlived its timeout; its attempt counts as failed and nothing it does now can commit",
		"job_id", jc.id, "kind", t.Type(), "attempt", jc.attempt, "deadline", deadline, "grace", g.cfg.TimeoutGrace)
	herr := fmt.Errorf("keel: handler still running %s after its deadline (%s): given up: %w",
		g.cfg.TimeoutGrace, deadline.UTC().Format(time.RFC3339), context.DeadlineExceeded)
	_ = g.recordFailure(ctx, t, jc, res, herr, retry.ClassTimeout)
	g.cfg.signals.Overran.Signal(jc.id)
}

// retireCrashed retires a poison job: the delivery is acknowledged (the job
// is dead in the ledger, with the same alert and counters as any death).
func (g *Guard) retireCrashed(ctx context.Context, t *asynq.Task, id string) error {
	ctx = context.WithoutCancel(ctx)
	summary := storableText(g.summarize(t), maxErrorBytes)
	r, err := ledger.RetireCrashed(ctx, g.store.Pool(), id, summary)
	businessKey, traceID, msg, attempts := r.BusinessKey, r.TraceID, r.Error, r.Attempts
	if errors.Is(err, pgx.ErrNoRows) {
		return retry.Wait(time.Second, ErrLeaseHeld) // it changed hands meanwhile: look again
	}
	if err != nil {
		g.stats.ledgerErrs.Add(1)
		return keepQueued(ctx, retry.Wait(g.ledgerWait(err), fmt.Errorf("keel: ledger unavailable, job %s not retired: %w", id, err)))
	}
	g.stats.crashed.Add(1)
	g.stats.dead.Add(1)
	outcome.Note(ctx, outcome.Retired)
	g.cfg.Logger.Error("keel: poison job retired", "job_id", id, "kind", t.Type(), "err", msg)
	g.died(ctx, jobstore.DeadEvent{JobID: id, Kind: t.Type(), Queue: queueName(ctx), BusinessKey: businessKey,
		Class: string(retry.ClassCrashed), Error: msg, TraceID: traceID, Attempts: attempts})
	return nil
}

// failedAfterCompleteMsg begins the error of a job failedAfterComplete
// records; the job is known by its effects_committed_at, not by this text.
const failedAfterCompleteMsg = "keel: handler failed after its completing InTx committed"

// failedAfterComplete handles a handler that failed after its completing
// InTx committed (a Step called after it, say): the local effects are in,
// but work the handler counted on did not happen. The job is not reported
// succeeded: it goes to the dead letters for a person.
func (g *Guard) failedAfterComplete(ctx context.Context, t *asynq.Task, jc *jobContext, herr error) error {
	ctx = context.WithoutCancel(ctx)
	g.cfg.Logger.Error("keel: handler failed after its completing InTx committed; the job goes to the dead letters",
		"job_id", jc.id, "err", herr)
	msg := storableText(fmt.Sprintf(failedAfterCompleteMsg+" "+
		"(its local effects are in; what came after did not happen; steps must come before the completing InTx): %v", herr), maxErrorBytes)
	summary := storableText(g.summarize(t), maxErrorBytes)
	var businessKey, traceID string
	// While the ledger is down this waits for it: given up, the row would
	// stay succeeded, the failure and its alert lost.
	err := g.untilLedgerAnswers(jc.id, func() error {
		var err error
		businessKey, traceID, err = ledger.DeadAfterComplete(ctx, g.store.Pool(), jc.id, msg, summary)
		return interpretError(err)
	})
	if err != nil {
		g.stats.ledgerErrs.Add(1)
		g.cfg.Logger.Error("keel: could not record a failure after completion", "job_id", jc.id, "err", err)
		return nil // the ledger says succeeded; a retry would only find it finished
	}
	g.stats.dead.Add(1)
	g.died(ctx, jobstore.DeadEvent{JobID: jc.id, Kind: t.Type(), Queue: queueName(ctx), BusinessKey: businessKey,
		Class: string(retry.ClassPermanent), Error: msg, TraceID: traceID, Attempts: jc.attempt})
	return fmt.Errorf("%w: %w", herr, asynq.SkipRetry)
}

// untilLedgerAnswers runs write again while the ledger cannot be reached,
// until it answers or the guard closes. The job stays this worker's
// meanwhile, its lease renewed once the ledger is back: a run that returned
// with its outcome unwritten would leave the lease to run out, and the next
// claim would count a crash and an attempt the outage made, not the job.
func (g *Guard) untilLedgerAnswers(id string, write func() error) error {
	for try := 1; ; try++ {
		err := write()
		if err == nil || !ledgerUnreachable(err) {
			return err
		}
		if try == 1 {
			g.stats.ledgerErrs.Add(1)
			g.cfg.Logger.Warn("keel: ledger unavailable; the run's outcome is written when it is back", "job_id", id, "err", err)
		}
		t := time.NewTimer(min(time.Duration(try)*100*time.Millisecond, time.Second))
		select {
		case <-g.ledger.Closed():
			t.Stop()
			return err
		case <-t.C:
		}
	}
}

func (g *Guard) markSucceeded(ctx context.Context, jc *jobContext) error {
	// The handler's work is done; a cancelled handler context must not stop
	// us recording it, or the next delivery would run it again.
	ctx = context.WithoutCancel(ctx)
	id := jc.id
	var err error
	complete := g.complete
	if result := jc.sealResult(); result != nil {
		// The result commits in the completion's own statement, outside
		// the shared round; jobs without one complete in the round.
		complete = func(ctx context.Context, jc *jobContext) error { return g.completeWithResult(ctx, jc, result) }
	}
	// The lease is renewed meanwhile; try for half of it before giving up,
	// and for as long as it takes while the ledger is unreachable.
	giveUp := time.Now().Add(g.cfg.Lease / 2)
	for try := 0; ; try++ {
		if try > 0 {
			time.Sleep(min(time.Duration(try*try)*100*time.Millisecond, time.Second))
		}
		if err = complete(ctx, jc); err == nil || errors.Is(err, ErrLeaseLost) || errors.Is(err, ErrGuardClosed) {
			break
		}
		if try+1 >= completionMarkTries && time.Now().After(giveUp) && !ledgerUnreachable(err) {
			break
		}
	}
	switch {
	case err == nil:
		g.ledgerAnswered()
		g.stats.succeeded.Add(1)
		return nil
	case errors.Is(err, ErrLeaseLost):
		if g.cancelledLate(ctx, jc) {
			return nil
		}
		// Another worker took the job over while this one ran; its run decides.
		g.cfg.Logger.Warn("keel: lease lost before completion was recorded", "job_id", id)
		return nil
	case errors.Is(err, ErrGuardClosed):
		// The worker closed before the success was recorded: its round
		// waited past Close's wait (on its batch's row, held by a
		// producer's transaction adding members, say). Left running, the
		// lease would run out into a crash charged to the job, which
		// retires a job without retries as a poison job. It is handed back
		// uncounted instead; its next run does again what is not recorded.
		g.stats.interrupted.Add(1)
		g.release(ctx, jc)
		outcome.Note(ctx, outcome.Interrupted)
		return retry.Wait(minLedgerWait, fmt.Errorf("keel: job %s finished but its worker closed before that was recorded; released to run again: %w", id, err))
	default:
		g.stats.ledgerErrs.Add(1)
		return retry.Wait(g.ledgerWait(err), fmt.Errorf("keel: job %s finished but the ledger could not record it: %w", id, err))
	}
}

// completeWithResult marks jc's run succeeded with its result, in one
// statement; ErrLeaseLost if the run no longer holds the job.
func (g *Guard) completeWithResult(ctx context.Context, jc *jobContext, result []byte) error {
	err := ledger.CompleteWithResult(ctx, g.store.Pool(), jc.id, g.cfg.Holder, jc.run, result)
	if errors.Is(err, pgx.ErrNoRows) {
		return ErrLeaseLost
	}
	return interpretError(err)
}

// waitCeiling is the most a claimed job may wait in all: its kind's
// MaxWait, or the guard's.
func (g *Guard) waitCeiling(res claimResult) time.Duration {
	if res.maxWait > 0 {
		return res.maxWait
	}
	return g.cfg.MaxWait
}

// waitDelay is how long a wait asks for (the policy's default when none).
func waitDelay(err error) time.Duration {
	if e, ok := retry.Marked(err); ok && e.Delay > 0 {
		return max(e.Delay, retry.MinDelay)
	}
	return retry.DefaultWaitDelay
}

func (g *Guard) recordFailure(ctx context.Context, t *asynq.Task, jc *jobContext, res claimResult, herr error, class retry.Class) error {
	ctx = context.WithoutCancel(ctx)
	id := jc.id
	attempts := res.attempts
	// The ledger's count alone decides the job's budget. asynq's is not the
	// same: it starts again whenever a job is published anew (a republish
	// after Redis lost data, a wait handed back), and it may count runs
	// keel released uncharged. Where asynq would archive a failure the
	// ledger retries, the task is revoked and handed to the relay instead.
	lastTry := attempts-1 >= res.maxRetry
	status := ledger.StatusFailed
	uncount := 0
	unpublish := false
	var delay, waited time.Duration
	switch {
	case class == retry.ClassWait:
		// Not a failure: the attempt does not count, but the time does,
		// up to the job's wait ceiling.
		waited = waitDelay(herr)
		ceiling := g.waitCeiling(res)
		if res.waited+waited > ceiling {
			status, class, waited = ledger.StatusDead, retry.ClassWaitedTooLong, 0
			herr = fmt.Errorf("keel: waited %s in all, over the job's wait ceiling of %s: %w",
				(res.waited + waited).Round(time.Second), ceiling, herr)
			break
		}
		status, uncount = ledger.StatusPending, 1
		if asynqLastTry(ctx) {
			// asynq would archive it: hand it back to the relay, which
			// publishes it when due — never before asynq has let go of the
			// current copy, or the relay's publish would be a no-op conflict.
			unpublish = true
			delay = max(waited, time.Second)
			herr = fmt.Errorf("%w: %w", herr, asynq.RevokeTask)
		}
	case errors.Is(herr, asynq.SkipRetry) || class == retry.ClassPermanent || lastTry:
		status = ledger.StatusDead
	case asynqLastTry(ctx):
		unpublish = true
		delay = time.Second
		if d, ok := retry.DecidedDelay(herr); ok {
			delay = max(d, time.Second)
		}
		herr = fmt.Errorf("%w: %w", herr, asynq.RevokeTask)
	}
	summary := ""
	if status == ledger.StatusDead {
		summary = g.summarize(t)
	}
	// When the job runs again, as run_at records it (keel status, the
	// reconciler): a wait handed back to the relay at its delay; a failure
	// when asynq retries it, as the retry middleware decided. -1: run_at
	// stays.
	runIn := -time.Millisecond
	if d, ok := retry.DecidedDelay(herr); ok && status == ledger.StatusFailed && !unpublish {
		runIn = d
	}
	if unpublish {
		runIn = delay
	}
	traceID := TraceID(ctx)
	msg := storableText(herr.Error(), maxErrorBytes)
	summary = storableText(summary, maxErrorBytes)
	var businessKey, storedTrace string
	err := g.untilLedgerAnswers(id, func() error {
		var err error
		businessKey, storedTrace, err = ledger.Fail(ctx, g.store.Pool(), ledger.Failure{ID: id, Holder: g.cfg.Holder, Run: jc.run,
			Status: status, Error: msg, Class: string(class), Uncount: uncount, Unpublish: unpublish,
			RunInMS: runIn.Milliseconds(), Summary: summary, TraceID: traceID, SpanTraceID: spanTraceID(ctx),
			WaitedMS: waited.Milliseconds(), InDoubt: errors.Is(herr, ErrInDoubt)})
		return err
	})
	if errors.Is(err, pgx.ErrNoRows) {
		if jc.commitInDoubt.Load() {
			if j, gerr := g.store.Get(ctx, id); gerr == nil && j.Status == ledger.StatusSucceeded {
				g.cfg.Logger.Warn("keel: InTx's commit was in doubt and did commit: the job succeeded", "job_id", id)
				g.stats.succeeded.Add(1)
				return nil
			}
		}
		if g.cancelledLate(ctx, jc) {
			return nil
		}
		g.cfg.Logger.Warn("keel: lease lost before failure was recorded", "job_id", id)
		return herr
	}
	if err != nil {
		g.stats.ledgerErrs.Add(1)
		g.cfg.Logger.Error("keel: could not record failure", "job_id", id, "err", err, "handler_err", herr)
		// The row stays running under our lease; it is retried after the lease.
		return herr
	}
	g.ledgerAnswered()
	if status != ledger.StatusDead && res.deadline != nil && runIn >= 0 {
		// Its next run would come at or after its deadline, where asynq
		// fails a delivery unrun: the job ends now instead. (A delay the
		// retry middleware did not decide is asynq's: HandleError ends the
		// job when that delivery fails.)
		if !res.deadline.After(time.Now().Add(runIn)) {
			if ended, dead := g.endAtDeadline(ctx, t, id, runIn+time.Millisecond); ended {
				if dead {
					return fmt.Errorf("%w: %w", herr, asynq.SkipRetry)
				}
				return fmt.Errorf("%w: %w", herr, asynq.RevokeTask)
			}
		}
	}
	noteFailure(ctx, status, class)
	switch status {
	case ledger.StatusDead:
		g.stats.dead.Add(1)
		g.died(ctx, jobstore.DeadEvent{JobID: id, Kind: t.Type(), Queue: queueName(ctx), BusinessKey: businessKey,
			Class: string(class), Error: msg, TraceID: storedTrace, Attempts: attempts})
		if !errors.Is(herr, asynq.SkipRetry) {
			herr = fmt.Errorf("%w: %w", herr, asynq.SkipRetry)
		}
	case ledger.StatusFailed:
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

// A run's state: live while the handler runs; then exactly one of the
// handler's return, the timeout watchdog and the shutdown decides its outcome.
const (
	runLive int32 = iota
	runReturned
	runAbandoned   // outlived its deadline: recorded as a timeout
	runInterrupted // cut short by shutdown: released, not counted
	runCancelled   // its job was cancelled: recorded by the canceller
)

// jobContext travels with a handler's context so Step and InTx know the job.
type jobContext struct {
	guard         *Guard
	id            string
	attempt       int
	run           int // with the holder, the run's identity in the ledger (attempt can repeat)
	pass          *gatePass
	batchID       string // its batch, if it is a member
	kind, queue   string
	completed     atomic.Bool
	commitInDoubt atomic.Bool
	// committing: its InTx sent COMMIT and it may have landed; until the
	// run notes it completed, a renewal finding the job succeeded at this
	// attempt knows it was this run's (see leaseFates).
	committing atomic.Bool
	state      atomic.Int32
	cancel     context.CancelCauseFunc
	ended      context.Context // see ProcessTask: ended by cancel, not by asynq
	inCall     atomic.Int32    // steps' calls in flight, with their records
	progress   progress        // the handler's progress reports (progress.go)

	// The result SetResult stored, written with the completion; sealed
	// once the completion is being sent.
	resultMu     sync.Mutex
	result       []byte
	resultSealed bool

	// The connection of the run's InTx while it is open (see dropTx).
	txMu      sync.Mutex
	txConn    *pgxpool.Conn
	txDropped bool
	txTaken   *pgx.Conn // the connection dropTx took from the pool
}

// holdTx notes conn as the open InTx's connection; false once the run was
// given up.
func (jc *jobContext) holdTx(conn *pgxpool.Conn) bool {
	jc.txMu.Lock()
	defer jc.txMu.Unlock()
	if jc.txDropped {
		return false
	}
	jc.txConn = conn
	return true
}

// endTx gives the InTx's connection back to the pool, or, if dropTx took it,
// closes what is left of it. Called by the run's own goroutine.
func (jc *jobContext) endTx(conn *pgxpool.Conn) {
	jc.txMu.Lock()
	mine := jc.txConn == conn
	if mine {
		jc.txConn = nil
	}
	taken := jc.txTaken
	jc.txTaken = nil
	jc.txMu.Unlock()
	if mine {
		conn.Release()
	} else if taken != nil {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_ = taken.Close(ctx)
	}
}

// dropTx ends the open InTx of a run keel gave up, from another goroutine:
// the handler may hang in its own code for ever, holding the transaction.
// Its connection leaves the pool, which may open another, and its socket
// is closed (safe while the handler's goroutine uses it), so Postgres rolls
// the transaction back and frees its locks. The run could commit nothing
// any more anyway.
func (jc *jobContext) dropTx() {
	jc.txMu.Lock()
	jc.txDropped = true
	conn := jc.txConn
	jc.txConn = nil
	var raw *pgx.Conn
	if conn != nil {
		raw = conn.Hijack()
		jc.txTaken = raw
	}
	jc.txMu.Unlock()
	if raw != nil {
		// A backend waiting on a lock notices a closed socket only when it
		// next writes: the cancel ends the wait first, so the rollback and
		// the freed locks come at once. Off this goroutine (the watchdog's,
		// or Close's, going through every run): the cancel dials Postgres.
		go func() {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			defer cancel()
			_ = raw.PgConn().CancelRequest(ctx)
			_ = raw.PgConn().Conn().Close()
		}()
	}
}

// usable refuses ledger work from a run keel has given up (timed out,
// interrupted) or whose job was cancelled.
func (jc *jobContext) usable() error {
	switch jc.state.Load() {
	case runAbandoned, runInterrupted:
		return fmt.Errorf("keel: job %s attempt %d: %w", jc.id, jc.attempt, ErrRunGivenUp)
	case runCancelled:
		return fmt.Errorf("keel: job %s attempt %d: %w", jc.id, jc.attempt, ErrCancelled)
	}
	return nil
}

// refused is the error for InTx or Step when this run no longer holds its
// job, or when err stopped it: ErrCancelled if the job was cancelled (asynq
// cancels the run's context then), else err.
func (jc *jobContext) refused(ctx context.Context, err error) error {
	if uerr := jc.usable(); uerr != nil {
		return uerr
	}
	if (errors.Is(err, ErrLeaseLost) || ctx.Err() != nil) && jc.guard.isCancelled(ctx, jc.id) {
		jc.guard.stopCancelled(jc)
		return jc.usable()
	}
	return err
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

// JobID is idempotency.JobID.
func JobID(ctx context.Context) (string, bool) {
	jc, err := jobFrom(ctx)
	if err != nil {
		return "", false
	}
	return jc.id, true
}

// Interrupted is idempotency.Interrupted.
func Interrupted(ctx context.Context) bool {
	jc, err := jobFrom(ctx)
	return err == nil && !jc.completed.Load() && errors.Is(context.Cause(ctx), context.Canceled)
}

// Attempt is idempotency.Attempt.
func Attempt(ctx context.Context) int {
	jc, err := jobFrom(ctx)
	if err != nil {
		return 0
	}
	return jc.attempt
}

type traceKey struct{}

// WithTraceID is idempotency.WithTraceID.
func WithTraceID(ctx context.Context, id string) context.Context {
	return context.WithValue(ctx, traceKey{}, id)
}

// TraceID is idempotency.TraceID.
func TraceID(ctx context.Context) string {
	s, _ := ctx.Value(traceKey{}).(string)
	return s
}

// inTx is InTx without its span.
func inTx(ctx context.Context, fn func(tx pgx.Tx) error) error {
	jc, err := jobFrom(ctx)
	if err != nil {
		return err
	}
	if jc.completed.Load() {
		return retry.Permanent(fmt.Errorf("keel: job %s: %w", jc.id, ErrAlreadyCompleted))
	}
	if err := jc.usable(); err != nil {
		return err
	}
	g := jc.guard
	conn, err := g.store.Pool().Acquire(ctx)
	if err != nil {
		return jc.refused(ctx, interpretError(err))
	}
	// Taken before holdTx: from then on dropTx may hijack conn from the
	// pool, and the pool's handle must not be read again.
	raw := conn.Conn()
	if !jc.holdTx(conn) {
		conn.Release()
		return jc.usable()
	}
	defer jc.endTx(conn)
	tx, err := raw.Begin(ctx)
	if err != nil {
		return jc.refused(ctx, interpretError(err))
	}
	committed := false
	defer func() {
		if !committed { // pgx's tx does not know of the COMMIT sent with the mark
			tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // the error is fn's or the mark's
		}
	}()
	if err := fn(tx); err != nil {
		// fn's statements run on the ledger's connection: losing it is
		// the ledger's outage, a wait, unless fn classed the error itself.
		if _, marked := retry.Marked(err); !marked && ledgerUnreachable(err) {
			return interpretError(err)
		}
		return err
	}
	// The mark and the COMMIT go in one round trip; the mark stops the
	// COMMIT if this run no longer holds the job.
	jc.committing.Store(true)
	err = ledger.MarkSucceededAndCommit(ctx, tx, jc.id, g.cfg.Holder, jc.run, jc.sealResult())
	if unsent := (*ledger.CommitUnsent)(nil); errors.As(err, &unsent) {
		jc.committing.Store(false)
		jc.unsealResult()
		if errors.Is(err, ledger.ErrNotHeld) {
			return jc.refused(ctx, ErrLeaseLost)
		}
		return jc.refused(ctx, interpretError(unsent.Err))
	}
	if err != nil {
		// The connection went after the mark and the COMMIT were sent: they
		// may or may not have landed. The guard looks at the row before it
		// records a failure.
		jc.commitInDoubt.Store(true)
		g.cfg.Logger.Warn("keel: InTx commit in doubt: the connection failed during COMMIT", "job_id", jc.id, "err", err)
		return fmt.Errorf("keel: job %s: commit in doubt: %w", jc.id, interpretError(err))
	}
	committed = true
	if h := g.inTxCommittedHook.Load(); h != nil {
		(*h)(jc.id)
	}
	jc.completed.Store(true)
	return nil
}

// memberRounds completes batch members in rounds of their own, one batcher
// per batch with completions waiting, closed once none waits.
type memberRounds struct {
	mu     sync.Mutex
	open   map[string]*memberBatch
	closed bool
	size   int
	run    func(ctx context.Context, reqs []ledgerReq)
}

type memberBatch struct {
	b     *batch.Batcher[ledgerReq]
	users int
}

// acquire returns batch id's batcher; release it once its completion is
// answered.
func (m *memberRounds) acquire(id string) (*batch.Batcher[ledgerReq], error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return nil, ErrGuardClosed
	}
	mb := m.open[id]
	if mb == nil {
		mb = &memberBatch{b: batch.New(1, m.size, ErrGuardClosed, m.run)}
		m.open[id] = mb
	}
	mb.users++
	return mb.b, nil
}

func (m *memberRounds) release(id string) {
	m.mu.Lock()
	mb := m.open[id]
	if mb == nil { // closed meanwhile
		m.mu.Unlock()
		return
	}
	if mb.users--; mb.users > 0 {
		m.mu.Unlock()
		return
	}
	delete(m.open, id)
	m.mu.Unlock()
	mb.b.Close()
}

// Close stops every batch's rounds; completions asked for later fail with
// ErrGuardClosed.
func (m *memberRounds) Close() {
	m.mu.Lock()
	m.closed = true
	open := m.open
	m.open = nil
	m.mu.Unlock()
	for _, mb := range open {
		mb.b.Close()
	}
}
