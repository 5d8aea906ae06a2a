package executor

import (
	"context"
	"sync"

	"github.com/keeljobs/keel/internal/ledger"
)

// flights are the steps' calls this worker has in flight, live runs' and
// given-up runs' alike: the renew loop keeps their call_until while they
// go on, so that no later run verifies or calls the step meanwhile.
type flights struct {
	mu    sync.Mutex
	calls map[*flight]struct{}
}

type flight struct {
	jobID, name string
	run         int
}

func (f *flights) add(jobID, name string, run int) *flight {
	c := &flight{jobID: jobID, name: name, run: run}
	f.mu.Lock()
	if f.calls == nil {
		f.calls = map[*flight]struct{}{}
	}
	f.calls[c] = struct{}{}
	f.mu.Unlock()
	return c
}

func (f *flights) remove(c *flight) {
	f.mu.Lock()
	delete(f.calls, c)
	f.mu.Unlock()
}

func (f *flights) list() (jobIDs, names []string, runs []int32) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for c := range f.calls {
		jobIDs, names, runs = append(jobIDs, c.jobID), append(names, c.name), append(runs, int32(c.run))
	}
	return jobIDs, names, runs
}

// renewFlights keeps this worker's calls in flight marked as such.
func (g *Guard) renewFlights(ctx context.Context) {
	ids, names, runs := g.inFlight.list()
	if len(ids) == 0 {
		return
	}
	rctx, cancel := context.WithTimeout(ctx, g.cfg.Lease/3)
	defer cancel()
	if err := ledger.RenewFlights(rctx, g.store.Pool(), g.cfg.Holder, g.cfg.Lease.Milliseconds(), ids, names, runs); err != nil && ctx.Err() == nil {
		g.stats.ledgerErrs.Add(1)
		g.cfg.Logger.Warn("keel: could not renew steps' calls in flight", "calls", len(ids), "err", err)
	}
}
