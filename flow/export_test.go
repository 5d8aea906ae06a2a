package flow

import "time"

// TestSignals are a controller's test signals.
type TestSignals = testSignals

// ErrLeaseLost is the Renewed signal of a slot found gone.
var ErrLeaseLost = errLeaseLost

// InitTestSignals turns c's test signals on; call it before c is used.
func InitTestSignals(c *Controller) *TestSignals {
	c.signals.Busy.Init()
	c.signals.Renewed.Init()
	c.signals.GivenBack.Init()
	return &c.signals
}

// RenewByHand makes c renew a held slot's lease once per value sent on the
// returned channel instead of on a ticker, and reports the interval the
// ticker would have had on every. Call it before c is used.
func RenewByHand(c *Controller) (tick chan<- time.Time, every <-chan time.Duration) {
	ticks := make(chan time.Time)
	intervals := make(chan time.Duration, 100)
	c.renewTicker = func(d time.Duration) <-chan time.Time {
		intervals <- d
		return ticks
	}
	return ticks, intervals
}
