package executor

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/keeljobs/keel/internal/ledger"
	"github.com/keeljobs/keel/internal/testsignal"
	"github.com/keeljobs/keel/retry"
)

// How long the gate keeps anyone waiting, each bounded by a fifth of what
// the delivery's deadline leaves, so that a run keeps most of its time.
const (
	// aloneWait bounds how long a run waits for the other runs on its
	// worker to finish so that it can run alone. Past it the run is handed
	// back as a wait, uncounted: the worker takes new work again, and
	// another worker (or this one, later) may be free sooner.
	aloneWait = time.Minute
	// holdWait bounds how long a delivery waits while a run runs alone (or
	// waits to) before it is handed back for another worker to start.
	holdWait = 5 * time.Second
	// aloneDrain bounds how long a worker takes no new work for a run that
	// was handed back because the others did not finish in time: on a
	// worker that always has a long job running, the run would otherwise
	// wait for an idle moment that never comes. The drain ends sooner once
	// the job is taken by another worker or ends (watchReservation).
	aloneDrain = 2 * time.Minute
	// drainIdle ends such a drain once the worker has been idle this long
	// without the run coming back (another worker took it).
	drainIdle = 10 * time.Second
)

// errNotAlone ends a wait at the gate that took longer than it may;
// errBesideHung one that cannot begin.
var (
	errNotAlone   = errors.New("keel: the other runs on this worker did not finish in time")
	errBesideHung = errors.New("keel: handlers keel gave up still run on this worker")
)

// aloneGate lets one run at a time run alone on its worker process. A job
// whose earlier run crashed (its worker died: a poison job, an OOM kill, a
// deploy's SIGKILL) runs its last run alone, so that keel only retires it
// as a poison job for a crash that can only be its own, not a neighbour's.
// While such a run waits for the others to finish, and while it runs, the
// worker starts nothing else.
type aloneGate struct {
	mu      sync.Mutex
	running int // runs between the gate and their end, keel's own
	// zombies are runs keel gave up (timed out, cancelled) whose handler
	// has not returned. A run beside one would not run alone: a crash
	// might be the hung handler's.
	zombies int
	owner   *gatePass     // the run that runs alone, or waits to
	changed chan struct{} // closed and replaced at a change someone waits for
	waiting int           // goroutines in await
	// shut: the worker is stopping. Nobody waits at the gate any more:
	// what waited is handed back for another worker to start.
	shut bool
	// reserved is a job whose run was handed back because the others did
	// not finish in time: until drainUntil, or until the worker has been
	// idle for drainIdle (idleSince), only that job starts here, so that
	// the worker drains and the run finds room when it comes back.
	reserved   string
	drainUntil time.Time
	idleSince  time.Time
	now        func() time.Time // the drain's clock; time.Now but in tests

	// waits tells tests each time a caller begins to wait, or waits again
	// after a change it was woken for did not let it through; off but in
	// tests. What it waits for had not happened when it was sent.
	waits testsignal.Signal[struct{}]
}

// gatePass is one run's place at the gate.
type gatePass struct {
	gate    *aloneGate
	counted bool // in gate.running
	zombie  bool // in gate.zombies
	givenUp bool
	left    bool
}

func newAloneGate() *aloneGate { return &aloneGate{changed: make(chan struct{}), now: time.Now} }

// close ends every wait at the gate; later ones do not wait.
func (g *aloneGate) close() {
	g.mu.Lock()
	defer g.mu.Unlock()
	if !g.shut {
		g.shut = true
		g.broadcast()
	}
}

// broadcast wakes every waiter; g.mu held. Most deliveries pass a gate
// nobody waits at: they pay nothing for it.
func (g *aloneGate) broadcast() {
	if g.waiting == 0 {
		return
	}
	close(g.changed)
	g.changed = make(chan struct{})
}

// await waits, g.mu held, until ready holds, ctx ends or timer fires.
func (g *aloneGate) await(ctx context.Context, timer <-chan time.Time, ready func() bool) error {
	for !ready() {
		if g.shut {
			return ErrGuardClosed
		}
		ch := g.changed
		g.waiting++
		g.waits.Signal(struct{}{})
		g.mu.Unlock()
		var err error
		select {
		case <-ch:
		case <-ctx.Done():
			err = context.Cause(ctx)
		case <-timer:
			err = errNotAlone
		}
		g.mu.Lock()
		g.waiting--
		if err == nil && g.shut {
			// Woken by the close, or after it: whatever else changed
			// meanwhile (a run that gave the gate up as it closed), a
			// closed gate lets nobody in.
			err = ErrGuardClosed
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// enter waits, up to wait, while a run runs alone or waits to, and then
// counts the caller among the worker's runs.
func (g *aloneGate) enter(ctx context.Context, wait time.Duration) (*gatePass, error) {
	return g.enterAs(ctx, "", wait)
}

// enterAs is enter for a delivery of job id: while the worker drains for a
// reserved job, only that job's delivery gets in.
func (g *aloneGate) enterAs(ctx context.Context, id string, wait time.Duration) (*gatePass, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.shut {
		return nil, ErrGuardClosed
	}
	if g.owner != nil || g.draining(id) {
		t := time.NewTimer(wait)
		defer t.Stop()
		if err := g.await(ctx, t.C, func() bool { return g.owner == nil && !g.draining(id) }); err != nil {
			return nil, err
		}
	}
	g.running++
	g.idleSince = time.Time{}
	return &gatePass{gate: g, counted: true}, nil
}

// draining reports whether the worker keeps job id out while it drains
// for a reserved job; g.mu held. A drain past its bound, or one the
// reserved job did not come back to while the worker stood idle, ends.
func (g *aloneGate) draining(id string) bool {
	if g.reserved == "" || id == g.reserved {
		return false
	}
	now := g.now()
	idle := g.running == 0 && g.zombies == 0 && !g.idleSince.IsZero() && now.Sub(g.idleSince) > drainIdle
	if now.After(g.drainUntil) || idle {
		g.reserved = ""
		return false
	}
	return true
}

// hung is how many runs keel gave up still run their handlers.
func (g *aloneGate) hung() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.zombies
}

// reserve makes the worker drain for job id, whose run could not run alone
// because the others did not finish in time: nothing else starts here
// until its run comes back and runs, for at most aloneDrain.
func (g *aloneGate) reserve(id string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.reserved, g.drainUntil = id, g.now().Add(aloneDrain)
	g.noteIdle()
}

// reservedFor reports whether the worker drains for job id.
func (g *aloneGate) reservedFor(id string) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.reserved == id
}

// unreserve ends a drain for job id, if it is still the one reserved.
func (g *aloneGate) unreserve(id string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.reserved == id {
		g.reserved = ""
		g.broadcast()
	}
}

// noteIdle starts the idle clock of a drain; g.mu held.
func (g *aloneGate) noteIdle() {
	if g.reserved != "" && g.running == 0 && g.zombies == 0 && g.idleSince.IsZero() {
		g.idleSince = g.now()
	}
}

// alone waits, up to wait, until p's run is the only one on the worker,
// hung handlers keel gave up included, and keeps others out until p
// leaves. While such a handler goes on, or once one appears, it waits no
// longer: the handler may hang for ever, and the worker would take no
// work meanwhile.
// p does not count while it waits, so two runs that must run alone take
// turns, not wait for each other for ever.
func (p *gatePass) alone(ctx context.Context, wait time.Duration) error {
	g := p.gate
	g.mu.Lock()
	defer g.mu.Unlock()
	if p.givenUp || p.left {
		return ErrRunGivenUp
	}
	if g.zombies > 0 {
		return errBesideHung
	}
	p.counted = false
	g.running--
	g.broadcast()
	t := time.NewTimer(wait)
	defer t.Stop()
	err := g.await(ctx, t.C, func() bool { return p.givenUp || g.owner == nil })
	if err == nil && !p.givenUp {
		g.owner = p
		g.reserved = "" // the drain, if any, was for this run or yields to it
		g.broadcast()
		err = g.await(ctx, t.C, func() bool { return p.givenUp || g.running == 0 || g.zombies > 0 })
		if err == nil && g.zombies > 0 {
			err = errBesideHung // a neighbour was given up, and hangs on
		}
	}
	if p.givenUp || p.left {
		return ErrRunGivenUp // giveUp let the others in again
	}
	p.counted = true
	g.running++
	if err != nil && g.owner == p {
		g.owner = nil
		g.broadcast()
	}
	return err
}

// giveUp is called when keel gives p's run up while its handler may go on
// (a timeout it ignores, a cancellation): it no longer holds up others,
// but counts as a zombie until it returns (leave).
func (p *gatePass) giveUp() {
	if p == nil {
		return
	}
	g := p.gate
	g.mu.Lock()
	defer g.mu.Unlock()
	if p.left || p.givenUp {
		return
	}
	p.givenUp = true
	if p.counted {
		p.counted = false
		g.running--
		p.zombie = true
		g.zombies++
	}
	if g.owner == p {
		g.owner = nil
	}
	g.broadcast()
}

// leave ends p's run at the gate: its handler returned, or it never ran.
func (p *gatePass) leave() {
	if p == nil {
		return
	}
	g := p.gate
	g.mu.Lock()
	defer g.mu.Unlock()
	if p.left {
		return
	}
	p.left = true
	if p.counted {
		g.running--
	}
	if p.zombie {
		g.zombies--
	}
	if g.owner == p {
		g.owner = nil
	}
	g.noteIdle()
	g.broadcast()
}

// gateWait bounds a wait at the gate by limit and by a fifth of what the
// delivery's deadline leaves.
func gateWait(ctx context.Context, limit time.Duration) time.Duration {
	if d, ok := ctx.Deadline(); ok {
		return max(min(limit, time.Until(d)/5), 0)
	}
	return limit
}

// runAlone lets jc's run start only once it is the only run on the worker,
// and records that it runs alone: if it crashes now, the crash is its own.
func (g *Guard) runAlone(ctx context.Context, jc *jobContext, res claimResult) error {
	if res.waited > g.waitCeiling(res) {
		// Its runs kept dying while they waited to run alone (each lost
		// lease counts as time waited): the wait ceiling ends it, as a
		// wait, never as a poison job.
		return retry.Wait(retry.MinDelay, fmt.Errorf("keel: job %s: its runs kept ending with their worker while they waited to run alone", jc.id))
	}
	g.cfg.Logger.Info("keel: the job's last run runs alone on this worker, since an earlier run crashed",
		"job_id", jc.id, "attempt", jc.attempt)
	began := time.Now()
	if err := jc.pass.alone(ctx, gateWait(ctx, aloneWait)); err != nil {
		if errors.Is(err, errNotAlone) {
			// The others did not finish in time: the worker drains for
			// this job, so that its run finds room when it comes back in
			// a moment, even on a worker that is never idle.
			g.gate.reserve(jc.id)
			go g.watchReservation(jc.id)
			return retry.Wait(retry.MinDelay, fmt.Errorf("keel: job %s must run alone on its worker (an earlier run crashed) and could not yet (waited %s); the worker takes no new work until it can: %w",
				jc.id, time.Since(began).Round(time.Millisecond), err))
		}
		if errors.Is(err, errBesideHung) || errors.Is(err, ErrGuardClosed) {
			waited := time.Since(began)
			return retry.Wait(max(waited, retry.MinDelay), fmt.Errorf("keel: job %s must run alone on its worker (an earlier run crashed) and could not (waited %s); handed back: %w",
				jc.id, waited.Round(time.Millisecond), err))
		}
		return err
	}
	held, err := ledger.MarkSolo(ctx, g.store.Pool(), jc.id, g.cfg.Holder, jc.run)
	if err != nil {
		if err = jc.refused(ctx, interpretError(err)); !errors.Is(err, ErrRunGivenUp) && !errors.Is(err, ErrCancelled) {
			// Not the job's failure: its last run must not be spent on it.
			err = retry.Wait(g.ledgerWait(err), err)
		}
		return err
	}
	if !held {
		return jc.refused(ctx, ErrLeaseLost)
	}
	return nil
}

// watchReservation ends this worker's drain for job id as soon as the job
// no longer needs it here: another worker took it (asynq hands a run back
// to whichever worker fetches it), or it ended. Draining for a job that
// went elsewhere would only hold every other job back.
func (g *Guard) watchReservation(id string) {
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for g.gate.reservedFor(id) {
		select {
		case <-g.ledger.Closed():
			return
		case <-t.C:
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		status, holder, err := ledger.Holder(ctx, g.store.Pool(), id)
		cancel()
		if errors.Is(err, pgx.ErrNoRows) || (err == nil && reservationMoot(status, holder, g.cfg.Holder)) {
			g.gate.unreserve(id)
			return
		}
	}
}

// reservationMoot tells a job a worker drains for that no longer needs
// it: running under another worker's lease, or ended.
func reservationMoot(status Status, holder, mine string) bool {
	switch status {
	case ledger.StatusPending, ledger.StatusFailed:
		return false
	case ledger.StatusRunning:
		return holder != mine
	}
	return true
}
