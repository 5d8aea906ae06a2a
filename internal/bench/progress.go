package bench

import (
	"sync"
	"time"
)

// Progress tells how far a run has come: Step (of Part, the Index-th of
// Parts parts) has done Done of Total units (jobs, samples). A step is
// reported when it starts (Done 0), every 200ms while it runs, and once
// more with Finished set when it ends.
type Progress struct {
	Part     string
	Index    int
	Parts    int
	Step     string
	Done     int
	Total    int
	Finished bool
	// Elapsed is the time since the step started.
	Elapsed time.Duration
}

// progressEvery is how often a running step reports.
const progressEvery = 200 * time.Millisecond

// step reports a step of total units whose progress done() tells, until the
// returned function is called.
func (e *env) step(name string, total int, done func() int) (finish func()) {
	report := e.o.Progress
	if report == nil {
		return func() {}
	}
	start := time.Now()
	p := Progress{Part: e.part, Index: e.index, Parts: e.parts, Step: name + e.roundLabel, Total: total}
	report(p)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		t := time.NewTicker(progressEvery)
		defer t.Stop()
		for {
			select {
			case <-stop:
				return
			case <-t.C:
				p.Done, p.Elapsed = min(done(), total), time.Since(start)
				report(p)
			}
		}
	})
	var once sync.Once
	return func() {
		once.Do(func() {
			close(stop)
			wg.Wait()
			p.Done, p.Elapsed, p.Finished = min(done(), total), time.Since(start), true
			report(p)
		})
	}
}
