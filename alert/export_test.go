package alert

// TestSignals are an Alerter's test signals; Flushed is what one carries.
type (
	TestSignals = testSignals
	Flushed     = flushed
)

// InitTestSignals turns a's test signals on; call it before Run.
func InitTestSignals(a *Alerter) *TestSignals {
	a.signals.Flushed.Init()
	a.signals.Retrying.Init()
	return &a.signals
}
