package testenv

import (
	"bytes"
	"log/slog"
	"sync"
	"testing"
)

// SyncBuffer is a buffer one goroutine writes (a child's output, a command's
// stdout) while the test reads it.
type SyncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *SyncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *SyncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// LogOnFailure is a logger whose lines the test shows only if it fails:
// what a worker logged before a failure, without the noise of every pass.
func LogOnFailure(t testing.TB) *slog.Logger {
	buf := &SyncBuffer{}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("what was logged:\n%s", buf.String())
		}
	})
	return slog.New(slog.NewTextHandler(buf, nil))
}
