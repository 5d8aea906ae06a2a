package tasks

import (
	"context"
	"errors"
	"sync"
)

// ErrClientClosed is returned by calls made after Close.
var ErrClientClosed = errors.New("keel: tasks client closed")

// batcher turns concurrent single-job requests into shared statements, as
// the guard's batcher in package idempotency does for claims: a few loops
// take whatever requests are waiting and run them as one. Under load this is
// group commit — one statement and one WAL flush for many enqueues — and
// when idle it adds no delay.
type batcher[R any] struct {
	in     chan R
	max    int
	run    func(ctx context.Context, reqs []R)
	wg     sync.WaitGroup
	stop   context.CancelFunc
	closed <-chan struct{}
}

func newBatcher[R any](loops, max int, run func(ctx context.Context, reqs []R)) *batcher[R] {
	ctx, cancel := context.WithCancel(context.Background())
	b := &batcher[R]{in: make(chan R, max*loops), max: max, run: run, stop: cancel, closed: ctx.Done()}
	for range loops {
		b.wg.Go(func() { b.loop(ctx) })
	}
	return b
}

func (b *batcher[R]) loop(ctx context.Context) {
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
		return ErrClientClosed
	default:
	}
	select {
	case b.in <- r:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	case <-b.closed:
		return ErrClientClosed
	}
}

func (b *batcher[R]) close() {
	b.stop()
	b.wg.Wait()
}
