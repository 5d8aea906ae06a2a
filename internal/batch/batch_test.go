package batch

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"
)

var errClosed = errors.New("closed")

// A request that is still waiting when the batcher stops must get an error,
// not hang: a handler that ignores its context can outlive the worker.
func TestBatcherCloseReleasesWaiters(t *testing.T) {
	block := make(chan struct{})
	running := make(chan []int, 2)
	b := New(1, 4, errClosed, func(ctx context.Context, reqs []int) {
		running <- reqs
		select {
		case <-block:
		case <-ctx.Done():
		}
	})
	if err := b.Submit(context.Background(), 1); err != nil {
		t.Fatal(err)
	}
	// Taken by the loop, which now blocks.
	select {
	case reqs := <-running:
		if len(reqs) != 1 || reqs[0] != 1 {
			t.Fatalf("first round ran %v, want [1]", reqs)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the loop never took the first request")
	}
	if err := b.Submit(context.Background(), 2); err != nil {
		t.Fatal(err)
	}
	if n := b.Queued(); n != 1 {
		t.Fatalf("%d requests queued, want the second one", n)
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

// Callers in a loop come back as soon as their round answers them. A new
// round must not start before the previous one has answered its callers
// (unless it is full): started early, it would hold only the first caller
// back, and the others would wait out a whole round for it. With 16
// callers that split every cycle into rounds of 15 and 1.
func TestSettlingRoundsWaitForThePreviousAnswers(t *testing.T) {
	const callers, calls, max = 16, 60, 64
	type req struct{ out chan struct{} }
	var (
		mu            sync.Mutex
		prev          chan struct{}
		prevAt        time.Time
		early, rounds int
		jobs          int
	)
	b := NewSettling(1, max, errClosed, func(ctx context.Context, reqs []req) <-chan struct{} {
		mu.Lock()
		// A round may start unanswered after maxSettleWait (a slow
		// Redis); a loaded machine can take that long.
		if prev != nil && len(reqs) < max && time.Since(prevAt) < maxSettleWait {
			select {
			case <-prev:
			default:
				early++
			}
		}
		rounds++
		jobs += len(reqs)
		settled := make(chan struct{})
		prev = settled
		mu.Unlock()
		defer func() { mu.Lock(); prevAt = time.Now(); mu.Unlock() }()
		// The round's statement, then its answers from the background (a
		// publish), as the tasks client's rounds do.
		time.Sleep(200 * time.Microsecond)
		answer := append([]req(nil), reqs...)
		go func() {
			time.Sleep(50 * time.Microsecond)
			for _, r := range answer {
				r.out <- struct{}{}
			}
			close(settled)
		}()
		return settled
	})
	defer b.Close()
	var wg sync.WaitGroup
	for range callers {
		wg.Go(func() {
			for range calls {
				r := req{out: make(chan struct{}, 1)}
				if err := b.Submit(context.Background(), r); err != nil {
					t.Error(err)
					return
				}
				<-r.out
			}
		})
	}
	wg.Wait()
	mu.Lock()
	defer mu.Unlock()
	if jobs != callers*calls {
		t.Fatalf("%d requests ran, want %d", jobs, callers*calls)
	}
	if early > 0 {
		t.Fatalf("%d of %d rounds started before the round before had answered its callers", early, rounds)
	}
	t.Logf("%d rounds, %.1f requests a round", rounds, float64(jobs)/float64(rounds))
}

// A round whose answers never come (a publish stuck on an unreachable
// Redis) must not stall the rounds after it for longer than maxSettleWait.
func TestSettlingRoundsDoNotWaitForeverForAnswers(t *testing.T) {
	type req struct{ out chan struct{} }
	b := NewSettling(1, 8, errClosed, func(ctx context.Context, reqs []req) <-chan struct{} {
		for _, r := range reqs {
			r.out <- struct{}{}
		}
		return make(chan struct{}) // never closed
	})
	defer b.Close()
	for i := range 5 {
		r := req{out: make(chan struct{}, 1)}
		if err := b.Submit(context.Background(), r); err != nil {
			t.Fatal(err)
		}
		select {
		case <-r.out:
		case <-time.After(10 * time.Second):
			t.Fatalf("request %d: no round ran while the round before had not settled", i)
		}
	}
}
