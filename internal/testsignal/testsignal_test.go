package testsignal_test

import (
	"fmt"
	"testing"

	"github.com/keeljobs/keel/internal/testsignal"
)

// fatal records a failure instead of ending the test.
type fatal struct{ msgs []string }

func (f *fatal) Helper() {}
func (f *fatal) Fatalf(format string, args ...any) {
	f.msgs = append(f.msgs, fmt.Sprintf(format, args...))
}

func TestOffSignalCostsNothingAndOnDeliversInOrder(t *testing.T) {
	var s testsignal.Signal[int]
	if s.On() {
		t.Fatal("a zero Signal is on")
	}
	s.Signal(1) // off: dropped, never blocks

	s.Init()
	s.Signal(2)
	s.Signal(3)
	s.Signal(4)
	if got := s.Wait(t); got != 2 {
		t.Fatalf("Wait = %d, want 2", got)
	}
	if got := s.WaitFor(t, func(v int) bool { return v == 4 }); got != 4 {
		t.Fatalf("WaitFor = %d, want 4", got)
	}
	s.RequireEmpty(t)

	s.Signal(5)
	f := &fatal{}
	s.RequireEmpty(f)
	if len(f.msgs) != 1 {
		t.Fatalf("RequireEmpty with an event waiting: %q", f.msgs)
	}
}

func TestWaitOnASignalNeverInitialisedFails(t *testing.T) {
	var s testsignal.Signal[string]
	f := &fatal{}
	s.RequireEmpty(f)
	if len(f.msgs) != 1 {
		t.Fatalf("RequireEmpty on an off signal: %q", f.msgs)
	}
}

func TestSharedSignalsAreOneStream(t *testing.T) {
	var a, b testsignal.Signal[string]
	a.Init()
	b.Share(&a)
	if !b.On() {
		t.Fatal("a shared Signal is off")
	}
	a.Signal("a")
	b.Signal("b")
	if got := a.Wait(t) + a.Wait(t); got != "ab" {
		t.Fatalf("got %q, want both events in order", got)
	}
}
