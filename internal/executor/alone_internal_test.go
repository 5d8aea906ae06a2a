package executor

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/internal/ledger"
)

// enterNow passes the gate, which must let the caller in.
func enterNow(t *testing.T, g *aloneGate) *gatePass {
	t.Helper()
	p, err := g.enter(context.Background(), time.Second)
	require.NoError(t, err)
	return p
}

// gateState reads the gate's counters.
func gateState(g *aloneGate) (running int, owned bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.running, g.owner != nil
}

// newTestGate is a gate whose waits signal the test.
func newTestGate() *aloneGate {
	g := newAloneGate()
	g.waits.Init()
	return g
}

// awaitGate waits until the gate's counters are as wanted. A run started
// in a goroutine gets there as it begins to wait, which the gate signals:
// the tests below synchronise on the gate's own events, not on sleeps.
func awaitGate(t *testing.T, g *aloneGate, running int, owned bool) {
	t.Helper()
	for {
		if r, o := gateState(g); r == running && o == owned {
			return
		}
		g.waits.Wait(t)
	}
}

// A run that must run alone waits for the runs beside it, and while it
// waits and runs nothing else starts.
func TestAloneRunWaitsForItsNeighboursAndKeepsOthersOut(t *testing.T) {
	ctx := context.Background()
	g := newTestGate()
	neighbour := enterNow(t, g)
	suspect := enterNow(t, g)

	alone := make(chan error, 1)
	go func() { alone <- suspect.alone(ctx, 5*time.Second) }()
	awaitGate(t, g, 1, true) // the neighbour runs, the suspect owns the gate

	entered := make(chan error, 1)
	go func() {
		p, err := g.enter(ctx, 5*time.Second)
		if err == nil {
			p.leave()
		}
		entered <- err
	}()
	g.waits.Wait(t) // the delivery was turned away to wait
	select {
	case err := <-alone:
		t.Fatalf("the run started alone beside a running neighbour: %v", err)
	case err := <-entered:
		t.Fatalf("a delivery started while a run waited to run alone: %v", err)
	default:
	}

	neighbour.leave()
	require.NoError(t, <-alone)
	awaitGate(t, g, 1, true)
	g.waits.Wait(t) // woken by the neighbour's leaving, the delivery waits again
	select {
	case err := <-entered:
		t.Fatalf("a delivery started beside the run that runs alone: %v", err)
	default:
	}
	suspect.leave()
	require.NoError(t, <-entered)
	awaitGate(t, g, 0, false)
}

// Two runs that must run alone take turns; neither waits for the other
// for ever.
func TestTwoAloneRunsTakeTurns(t *testing.T) {
	ctx := context.Background()
	g := newTestGate()
	a := enterNow(t, g)
	b := enterNow(t, g)
	done := make(chan *gatePass, 2)
	for _, p := range []*gatePass{a, b} {
		go func() {
			if p.alone(ctx, 5*time.Second) == nil {
				done <- p
			}
		}()
	}
	first := <-done
	awaitGate(t, g, 1, true)
	first.leave()
	second := <-done
	require.NotSame(t, first, second)
	second.leave()
	awaitGate(t, g, 0, false)
}

// A wait that takes too long ends, and the gate is as it was: the run
// counts again, nothing is kept out.
func TestAloneWaitGivesUpAndOpensTheGate(t *testing.T) {
	ctx := context.Background()
	g := newTestGate()
	hung := enterNow(t, g)
	suspect := enterNow(t, g)
	require.ErrorIs(t, suspect.alone(ctx, 20*time.Millisecond), errNotAlone)
	awaitGate(t, g, 2, false)
	p, err := g.enter(ctx, time.Second)
	require.NoError(t, err, "the gate stayed shut after the wait gave up")
	p.leave()
	suspect.leave()
	hung.leave()
	awaitGate(t, g, 0, false)

	// A delivery gives up waiting too, and is not counted.
	owner := enterNow(t, g)
	require.NoError(t, owner.alone(ctx, time.Second))
	_, err = g.enter(ctx, 20*time.Millisecond)
	require.ErrorIs(t, err, errNotAlone)
	cctx, cancel := context.WithCancelCause(ctx)
	cause := errors.New("shutting down")
	cancel(cause)
	_, err = g.enter(cctx, time.Second)
	require.ErrorIs(t, err, cause)
	awaitGate(t, g, 1, true)
	owner.leave()
	awaitGate(t, g, 0, false)
}

// A run keel gives up while it waits to run alone stops holding up the
// others at once. A handler keel gave up that has not returned ends the
// wait of a run that must run alone as soon as it appears, and such a run
// does not wait at all while one goes on: a crash might be the hung one's.
func TestAGivenUpRunAndTheGate(t *testing.T) {
	ctx := context.Background()
	g := newTestGate()
	neighbour := enterNow(t, g)
	waiting := enterNow(t, g)
	alone := make(chan error, 1)
	go func() { alone <- waiting.alone(ctx, 5*time.Second) }()
	awaitGate(t, g, 1, true)
	waiting.giveUp() // given up while it waits: it ran no handler
	require.ErrorIs(t, <-alone, ErrRunGivenUp)
	awaitGate(t, g, 1, false)
	waiting.leave() // its delivery returns
	awaitGate(t, g, 1, false)
	require.Zero(t, g.zombies, "a run that never started its handler counted as one still going")

	// The neighbour hangs and keel gives it up: the run that waits to run
	// alone stops waiting at once, and is handed back.
	suspect := enterNow(t, g)
	began := time.Now()
	go func() { alone <- suspect.alone(ctx, 5*time.Second) }()
	awaitGate(t, g, 1, true)
	neighbour.giveUp()
	require.ErrorIs(t, <-alone, errBesideHung)
	require.Less(t, time.Since(began), 4*time.Second, "it waited out its wait beside a hung handler")
	awaitGate(t, g, 1, false)
	require.Equal(t, 1, g.zombies)
	neighbour.leave() // the hung handler returns at last
	require.Zero(t, g.zombies)
	require.NoError(t, suspect.alone(ctx, 5*time.Second), "alone at last")

	// It hangs in turn and is given up; the next run that must run alone
	// is handed back at once, and keeps nobody out.
	suspect.giveUp()
	awaitGate(t, g, 0, false)
	next := enterNow(t, g)
	require.ErrorIs(t, next.alone(ctx, time.Minute), errBesideHung)
	awaitGate(t, g, 1, false)
	next.leave()
	suspect.leave()
	awaitGate(t, g, 0, false)
	require.Zero(t, g.zombies)
}

// A worker that begins to stop keeps nobody waiting at its gate: a run that
// waits to run alone and the deliveries behind it are handed back at once.
func TestAStoppingWorkerKeepsNobodyAtTheGate(t *testing.T) {
	ctx := context.Background()
	g := newTestGate()
	neighbour := enterNow(t, g)
	suspect := enterNow(t, g)
	alone := make(chan error, 1)
	go func() { alone <- suspect.alone(ctx, time.Minute) }()
	awaitGate(t, g, 1, true)
	entered := make(chan error, 1)
	go func() {
		_, err := g.enter(ctx, time.Minute)
		entered <- err
	}()
	g.close()
	require.ErrorIs(t, <-alone, ErrGuardClosed)
	require.ErrorIs(t, <-entered, ErrGuardClosed)
	suspect.leave()
	neighbour.leave()
	awaitGate(t, g, 0, false)
}

// A worker drains for a run handed back for want of room: only that job's
// delivery gets in, until its run takes the gate, the worker stands idle
// for drainIdle without it, or aloneDrain passes.
func TestAGateDrainsForAReservedRunAndNotForEver(t *testing.T) {
	ctx := context.Background()
	now := time.Now()
	g := newTestGate()
	g.now = func() time.Time { return now }
	busy := enterNow(t, g)
	g.reserve("crashed")
	_, err := g.enterAs(ctx, "other", 10*time.Millisecond)
	require.ErrorIs(t, err, errNotAlone, "new work got in while the worker drains")
	back, err := g.enterAs(ctx, "crashed", time.Second)
	require.NoError(t, err, "the reserved job's run was kept out")
	back.leave()

	// Idle, but the reserved job went to another worker: the drain ends.
	busy.leave()
	_, err = g.enterAs(ctx, "other", 10*time.Millisecond)
	require.ErrorIs(t, err, errNotAlone)
	now = now.Add(drainIdle + time.Second)
	p, err := g.enterAs(ctx, "other", time.Second)
	require.NoError(t, err, "an idle worker kept draining for a job that went elsewhere")
	p.leave()

	// Never idle: the drain still ends at aloneDrain.
	busy = enterNow(t, g)
	g.reserve("crashed")
	now = now.Add(aloneDrain + time.Second)
	p, err = g.enterAs(ctx, "other", time.Second)
	require.NoError(t, err, "the drain outlived its bound")
	p.leave()
	busy.leave()
}

// A drain for a job ends once another worker runs it or it has ended.
func TestADrainForAJobThatWentElsewhereIsMoot(t *testing.T) {
	for _, tc := range []struct {
		status Status
		holder string
		moot   bool
	}{
		{ledger.StatusPending, "", false},
		{ledger.StatusFailed, "", false},
		{ledger.StatusRunning, "me", false},
		{ledger.StatusRunning, "another", true},
		{ledger.StatusSucceeded, "", true},
		{ledger.StatusDead, "", true},
		{ledger.StatusCancelled, "", true},
	} {
		require.Equal(t, tc.moot, reservationMoot(tc.status, tc.holder, "me"), "%s held by %q", tc.status, tc.holder)
	}
	g := newTestGate()
	g.reserve("crashed")
	require.True(t, g.reservedFor("crashed"))
	g.unreserve("other")
	require.True(t, g.reservedFor("crashed"), "another job's end ended the drain")
	g.unreserve("crashed")
	p, err := g.enterAs(context.Background(), "other", time.Second)
	require.NoError(t, err, "the drain outlived its job")
	p.leave()
}
