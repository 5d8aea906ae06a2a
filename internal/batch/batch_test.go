package batch

import (
	"context"
	"errors"
	"testing"
	"time"
)

var errClosed = errors.New("closed")

// A request that is still waiting when the batcher stops must get an error,
// not hang: a handler that ignores its context can outlive the worker.
func TestBatcherCloseReleasesWaiters(t *testing.T) {
	block := make(chan struct{})
	b := New(1, 4, errClosed, func(ctx context.Context, reqs []int) {
		select {
		case <-block:
		case <-ctx.Done():
		}
	})
	if err := b.Submit(context.Background(), 1); err != nil { // taken by the loop, which then blocks
		t.Fatal(err)
	}
	time.Sleep(20 * time.Millisecond)
	if err := b.Submit(context.Background(), 2); err != nil { // queued, never run
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		<-b.Closed()
	}()
	b.Close()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("waiters were not released")
	}
	if err := b.Submit(context.Background(), 3); !errors.Is(err, errClosed) {
		t.Fatalf("submit after close: %v, want the closed error", err)
	}
	close(block)
}
