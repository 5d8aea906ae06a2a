package scheduler

// TestSignals are a scheduler's test signals.
type TestSignals = testSignals

// InitTestSignals turns s's test signals on; call it before Run.
func InitTestSignals(s *Scheduler) *TestSignals {
	s.signals.Looked.Init()
	s.signals.Synced.Init()
	s.signals.Reloaded.Init()
	s.signals.Polled.Init()
	return &s.signals
}
