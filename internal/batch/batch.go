// Package batch turns many concurrent single-row requests into a few shared
// statements: a handful of loops take whatever requests are waiting and run
// them as one. Under load this is group commit — one round trip and one WAL
// flush for dozens of jobs — and when idle it adds no delay. The ledger
// guard batches claims and completions with it, the tasks client enqueues.
package batch

import (
	"context"
	"runtime"
	"sync"
	"time"
)

// Batcher runs requests of type R in shared rounds.
type Batcher[R any] struct {
	in  chan R
	max int
	// run runs a round; a round that answers its callers after run returns
	// (in the background) returns a channel closed once they have their
	// answers (see awaitSettled), others nil.
	run       func(ctx context.Context, reqs []R) <-chan struct{}
	closedErr error
	wg        sync.WaitGroup
	stop      context.CancelFunc
	// closed ends every wait once the batcher stops, so a caller that
	// outlives its owner's shutdown gets an error instead of hanging.
	closed <-chan struct{}
}

// New starts loops loops, each running up to max waiting requests at a
// time through run. Submit returns closedErr once Close was called.
func New[R any](loops, max int, closedErr error, run func(ctx context.Context, reqs []R)) *Batcher[R] {
	return NewSettling(loops, max, closedErr, func(ctx context.Context, reqs []R) <-chan struct{} {
		run(ctx, reqs)
		return nil
	})
}

// NewSettling is New for rounds that answer their callers after run
// returns (in the background): run returns a channel closed once they have
// their answers, and the next round waits for it unless it fills up first.
func NewSettling[R any](loops, max int, closedErr error, run func(ctx context.Context, reqs []R) <-chan struct{}) *Batcher[R] {
	ctx, cancel := context.WithCancel(context.Background())
	b := &Batcher[R]{in: make(chan R, max*loops), max: max, run: run, closedErr: closedErr, stop: cancel, closed: ctx.Done()}
	for range loops {
		b.wg.Go(func() { b.loop(ctx) })
	}
	return b
}

// maxSettleWait bounds how long a round waits for the one before to
// answer its callers; normally that takes a Redis round trip.
const maxSettleWait = 2 * time.Millisecond

// settleYields bounds how often a held-back round yields the processor to
// let answered callers come back.
const settleYields = 8

func (b *Batcher[R]) loop(ctx context.Context) {
	reqs := make([]R, 0, b.max)
	var settled <-chan struct{}
	for {
		select {
		case <-ctx.Done():
			return
		case r := <-b.in:
			reqs = append(reqs[:0], r)
			if settled != nil && !b.awaitSettled(ctx, settled, &reqs) {
				return
			}
			b.drain(&reqs)
			settled = b.run(ctx, reqs)
		}
	}
}

func (b *Batcher[R]) drain(reqs *[]R) {
	for len(*reqs) < b.max {
		select {
		case r := <-b.in:
			*reqs = append(*reqs, r)
		default:
			return
		}
	}
}

// awaitSettled holds a new round back while the previous one's callers are
// about to get their answers, then lets those that come straight back join
// it: without this a round's first straggler goes alone and the others wait
// out a whole commit for it (rounds of 15 and 1 with 16 callers in a loop).
// The wait is on events, not a timer: Go sleeps at least a millisecond for
// any shorter timer once the process is idle.
func (b *Batcher[R]) awaitSettled(ctx context.Context, settled <-chan struct{}, reqs *[]R) bool {
	// Bounded: a round whose answers wait on a slow Redis must not stall
	// the rounds after it.
	wait := time.NewTimer(maxSettleWait)
	defer wait.Stop()
	for len(*reqs) < b.max {
		select {
		case <-ctx.Done():
			return false
		case r := <-b.in:
			*reqs = append(*reqs, r)
			continue
		case <-settled:
		case <-wait.C:
			return true
		}
		break
	}
	for range settleYields {
		before := len(*reqs)
		runtime.Gosched()
		b.drain(reqs)
		if len(*reqs) == before || len(*reqs) == b.max {
			break
		}
	}
	return true
}

// Submit queues r; it fails when ctx ends or the batcher stops first.
func (b *Batcher[R]) Submit(ctx context.Context, r R) error {
	select {
	case <-b.closed:
		return b.closedErr
	default:
	}
	select {
	case b.in <- r:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	case <-b.closed:
		return b.closedErr
	}
}

// Queued is how many submitted requests wait for a round.
func (b *Batcher[R]) Queued() int { return len(b.in) }

// Closed is closed once the batcher stops: waiters for a result select on it.
func (b *Batcher[R]) Closed() <-chan struct{} { return b.closed }

// Close stops the loops, cancelling the round in flight, and waits for them.
func (b *Batcher[R]) Close() {
	b.stop()
	b.wg.Wait()
}
