// Package batch turns many concurrent single-row requests into a few shared
// statements: a handful of loops take whatever requests are waiting and run
// them as one. Under load this is group commit — one round trip and one WAL
// flush for dozens of jobs — and when idle it adds no delay. The ledger
// guard batches claims and completions with it, the tasks client enqueues.
package batch

import (
	"context"
	"sync"
)

// Batcher runs requests of type R in shared rounds.
type Batcher[R any] struct {
	in        chan R
	max       int
	run       func(ctx context.Context, reqs []R)
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
	ctx, cancel := context.WithCancel(context.Background())
	b := &Batcher[R]{in: make(chan R, max*loops), max: max, run: run, closedErr: closedErr, stop: cancel, closed: ctx.Done()}
	for range loops {
		b.wg.Go(func() { b.loop(ctx) })
	}
	return b
}

func (b *Batcher[R]) loop(ctx context.Context) {
	reqs := make([]R, 0, b.max)
	for {
		select {
		case <-ctx.Done():
			return
		case r := <-b.in:
			reqs = append(reqs[:0], r)
		drain:
			for len(reqs) < b.max {
				select {
				case r := <-b.in:
					reqs = append(reqs, r)
				default:
					break drain
				}
			}
			b.run(ctx, reqs)
		}
	}
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
