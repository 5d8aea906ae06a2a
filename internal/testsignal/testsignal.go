// Package testsignal lets a background service tell its tests that
// something happened: a tick looked at, a lease renewed, a window flushed.
// A Signal is a channel that is nil until a test calls Init, so a service
// in production pays one nil check per event and allocates nothing.
//
// Tests wait on a signal instead of on the clock, and assert that nothing
// more happened right after a signal that proves the service looked.
package testsignal

import (
	"fmt"
	"time"
)

// TB is the part of testing.TB a Signal uses; the package does not import
// testing, which the services that hold signals are built without.
type TB interface {
	Helper()
	Fatalf(format string, args ...any)
}

// bufferSize bounds the events a test may leave unread. A full buffer
// panics rather than blocking the service or dropping an event a test
// might be waiting for.
const bufferSize = 1000

// Timeout is how long Wait waits: a deadlock guard, not a timing
// assertion, so it is generous for a slow host under the race detector.
const Timeout = 30 * time.Second

// Signal carries events of type T from a service to its test. The zero
// value is off: Signal does nothing.
type Signal[T any] struct {
	ch chan T
}

// Init turns s on. Call it before the service starts, so that the service
// reads the channel only after it was set.
func (s *Signal[T]) Init() {
	s.ch = make(chan T, bufferSize)
}

// Share turns s on with o's channel, so that a test waits on the events
// of two services (two relays, say) as one stream. o must be on.
func (s *Signal[T]) Share(o *Signal[T]) {
	s.ch = o.ch
}

// On reports whether a test listens: a service guards with it an event
// that costs something to build.
func (s *Signal[T]) On() bool { return s.ch != nil }

// Signal sends v to the test, if one listens.
func (s *Signal[T]) Signal(v T) {
	if s.ch == nil {
		return
	}
	select {
	case s.ch <- v:
	default:
		panic(fmt.Sprintf("testsignal: %d events of %T unread", bufferSize, v))
	}
}

// Wait returns the next event, failing the test if none comes within
// Timeout.
func (s *Signal[T]) Wait(tb TB) T {
	tb.Helper()
	s.mustBeOn(tb)
	select {
	case v := <-s.ch:
		return v
	case <-time.After(Timeout):
		tb.Fatalf("testsignal: no %T event within %s", *new(T), Timeout)
		panic("unreachable")
	}
}

// WaitFor returns the first event that match accepts, dropping those
// before it.
func (s *Signal[T]) WaitFor(tb TB, match func(T) bool) T {
	tb.Helper()
	s.mustBeOn(tb)
	deadline := time.NewTimer(Timeout)
	defer deadline.Stop()
	for {
		select {
		case v := <-s.ch:
			if match(v) {
				return v
			}
		case <-deadline.C:
			tb.Fatalf("testsignal: no matching %T event within %s", *new(T), Timeout)
		}
	}
}

// RequireEmpty fails the test if an event is waiting: something happened
// that the test did not expect.
func (s *Signal[T]) RequireEmpty(tb TB) {
	tb.Helper()
	s.mustBeOn(tb)
	select {
	case v := <-s.ch:
		tb.Fatalf("testsignal: unexpected event %+v", v)
	default:
	}
}

func (s *Signal[T]) mustBeOn(tb TB) {
	tb.Helper()
	if s.ch == nil {
		tb.Fatalf("testsignal: signal not initialised: call Init before starting the service")
	}
}
