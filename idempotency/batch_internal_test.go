package idempotency

import (
	"context"
	"errors"
	"testing"
	"time"
)

// A request that is still waiting when the batcher stops must get an error,
// not hang: a handler that ignores its context can outlive the worker.
func TestBatcherCloseReleasesWaiters(t *testing.T) {
	block := make(chan struct{})
	b := newBatcher(1, 4, func(ctx context.Context, reqs []int) {
		select {
		case <-block:
		case <-ctx.Done():
		}
	})
	if err := b.submit(context.Background(), 1); err != nil { // taken by the loop, which then blocks
		t.Fatal(err)
	}
	time.Sleep(20 * time.Millisecond)
	if err := b.submit(context.Background(), 2); err != nil { // queued, never run
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		<-b.closed
	}()
	b.close()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("waiters were not released")
	}
	if err := b.submit(context.Background(), 3); !errors.Is(err, ErrGuardClosed) {
		t.Fatalf("submit after close: %v, want ErrGuardClosed", err)
	}
	close(block)
}
