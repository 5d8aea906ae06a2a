// Package wake lets an idle keel worker wait for work instead of polling
// Redis for it. asynq's processor looks into every queue, sleeps 15–45 ms
// when all are empty, and looks again: about 300 Redis commands a second
// for an idle worker with three queues, and no way to be woken. A Waiter,
// installed as a hook on the asynq server's Redis client, holds the first
// look of a round that follows an empty round until work is announced on
// Channel (keel's publishes announce it from inside their Redis scripts),
// the server's own forwarder moves due retries and scheduled jobs into a
// queue, or MaxWait passes. Nothing is lost by waiting: a task nobody
// announced (an asynq client's, a task asynqmon runs) is found MaxWait
// later at most.
package wake

import (
	"context"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/keeljobs/keel/internal/asynqwire"
)

// Channel is where keel announces work: its publish and rescue scripts
// PUBLISH the queue's name on it (asynqwire).
const Channel = asynqwire.WakeChannel

// maxRoundGap bounds the gap that tells one of asynq's polling rounds from
// the next: within a round the processor looks into its queues back to
// back; between rounds it sleeps at least half its TaskCheckInterval.
const maxRoundGap = 5 * time.Millisecond

// Waiter is the go-redis hook (see package doc). Make it with New.
type Waiter struct {
	maxWait  time.Duration
	roundGap time.Duration

	mu         sync.Mutex
	woken      chan struct{} // closed and replaced at each wake
	seq        uint64        // wakes so far
	lastEnd    time.Time     // when the last look into a queue answered
	roundEmpty bool          // every look of the current round found nothing
	roundSeq   uint64        // seq when the current round began
	closed     bool
	waits      uint64 // looks held, for tests and stats
}

// New returns a Waiter that holds an idle worker's look at most maxWait,
// for an asynq server polling every poll (its TaskCheckInterval).
func New(maxWait, poll time.Duration) *Waiter {
	return &Waiter{maxWait: maxWait, roundGap: min(maxRoundGap, poll/3), woken: make(chan struct{})}
}

// Wake ends every wait now, and the next one before it begins.
func (w *Waiter) Wake() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.seq++
	close(w.woken)
	w.woken = make(chan struct{})
}

// Close ends every wait for good: the worker is stopping.
func (w *Waiter) Close() {
	w.mu.Lock()
	w.closed = true
	w.mu.Unlock()
	w.Wake()
}

// Waits returns how many looks the waiter has held so far.
func (w *Waiter) Waits() uint64 {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.waits
}

// before is called as a look into a queue begins. It returns the channel to
// wait on, or nil to look at once: at the first look of a round that
// follows a round that found nothing, with no wake since that round began.
func (w *Waiter) before(now time.Time) <-chan struct{} {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed || w.lastEnd.IsZero() || now.Sub(w.lastEnd) < w.roundGap {
		return nil // the first look ever, or the same round
	}
	idle := w.roundEmpty && w.seq == w.roundSeq
	w.roundEmpty, w.roundSeq = true, w.seq
	if !idle {
		return nil
	}
	w.waits++
	return w.woken
}

// after is called when a look answered: found tells whether it took a task.
func (w *Waiter) after(found bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.lastEnd = time.Now()
	if found {
		w.roundEmpty = false
	}
}

// DialHook implements redis.Hook.
func (w *Waiter) DialHook(next redis.DialHook) redis.DialHook { return next }

// ProcessPipelineHook implements redis.Hook.
func (w *Waiter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// ProcessHook implements redis.Hook: it holds the idle processor's looks
// and wakes the waiter when the server's forwarder moved tasks into a
// queue.
func (w *Waiter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		switch {
		case asynqwire.IsDequeue(cmd):
			if ch := w.before(time.Now()); ch != nil {
				t := time.NewTimer(w.maxWait)
				select {
				case <-ch:
				case <-t.C:
				case <-ctx.Done():
				}
				t.Stop()
			}
			err := next(ctx, cmd)
			w.after(err == nil)
			return err
		case asynqwire.IsForward(cmd):
			err := next(ctx, cmd)
			if n, ok := cmd.(*redis.Cmd); ok && err == nil {
				if moved, _ := n.Int64(); moved > 0 {
					w.Wake()
				}
			}
			return err
		}
		return next(ctx, cmd)
	}
}

// Listen wakes w whenever work is announced on Channel, and whenever its
// subscription (re)starts, since announcements may have been missed
// meanwhile, until ctx ends.
func Listen(ctx context.Context, rc redis.UniversalClient, w *Waiter) {
	ps := rc.Subscribe(ctx, Channel)
	defer ps.Close()
	ch := ps.ChannelWithSubscriptions()
	for {
		select {
		case <-ctx.Done():
			return
		case _, ok := <-ch:
			if !ok {
				return
			}
			w.Wake()
		}
	}
}
