package keeltest

// OnRedeliverWait sets what h's Redeliver calls each time it finds asynq's
// copy of the job still there and waits for it.
func OnRedeliverWait(h *Harness, f func()) { h.redeliverWaited = f }
