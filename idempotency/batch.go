package idempotency

import (
	"context"
	"sync"
)

// batcher turns many concurrent single-row requests into a few shared
// statements: a handful of loops take whatever requests are waiting and run
// them as one. Under load this is group commit — one round trip and one WAL
// flush for dozens of jobs — and when idle it adds no delay.
type batcher[R any] struct {
	in   chan R
	max  int
	run  func(ctx context.Context, reqs []R)
	wg   sync.WaitGroup
	stop context.CancelFunc
	// closed ends every wait once the batcher stops, so a handler that
	// outlives its worker's shutdown gets an error instead of hanging.
	closed <-chan struct{}
}

func newBatcher[R any](loops, max int, run func(ctx context.Context, reqs []R)) *batcher[R] {
	ctx, cancel := context.WithCancel(context.Background())
	b := &batcher[R]{in: make(chan R, max*loops), max: max, run: run, stop: cancel, closed: ctx.Done()}
	for range loops {
		b.wg.Add(1)
		go b.loop(ctx)
	}
	return b
}

func (b *batcher[R]) loop(ctx context.Context) {
	defer b.wg.Done()
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

// submit queues r; it fails when ctx ends or the batcher stops first.
func (b *batcher[R]) submit(ctx context.Context, r R) error {
	select {
	case <-b.closed:
		return ErrGuardClosed
	default:
	}
	select {
	case b.in <- r:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	case <-b.closed:
		return ErrGuardClosed
	}
}

func (b *batcher[R]) close() {
	b.stop()
	b.wg.Wait()
}
