package executor

import (
	"context"
	"sync"
	"time"

	"github.com/keeljobs/keel/internal/ledger"
)

// strays are the handlers on this worker that keel gave up (at their
// timeout, or because their job was cancelled) and that have not returned:
// they may still act. Their jobs' stray_until is renewed while they run, so
// that a newer job of the same key does not start beside them (roundCTEs),
// and cleared when the last of a job's strays here returns.
type strays struct {
	mu   sync.Mutex
	jobs map[string]int // job id → its strays on this worker
}

func (s *strays) add(id string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.jobs == nil {
		s.jobs = map[string]int{}
	}
	s.jobs[id]++
}

// done notes that one stray of job id returned; it reports whether it was
// the job's last here.
func (s *strays) done(id string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.jobs[id] <= 1 {
		delete(s.jobs, id)
		return true
	}
	s.jobs[id]--
	return false
}

func (s *strays) has(id string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.jobs[id] > 0
}

func (s *strays) list() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	ids := make([]string, 0, len(s.jobs))
	for id := range s.jobs {
		ids = append(ids, id)
	}
	return ids
}

// markStray records that jc's handler is given up but may still act. It is
// written before the run's outcome, which may finish the job and free its
// key for a newer job.
func (g *Guard) markStray(jc *jobContext) {
	g.strays.add(jc.id)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := ledger.MarkStrays(ctx, g.store.Pool(), []string{jc.id}, g.cfg.Lease.Milliseconds()); err != nil {
		g.stats.ledgerErrs.Add(1)
		g.cfg.Logger.Warn("keel: could not record a given-up handler that may still act", "job_id", jc.id, "err", err)
	}
}

// strayReturned notes that a given-up handler returned: once none of its
// job's is left here, a newer job of its key may start.
func (g *Guard) strayReturned(jc *jobContext) {
	if g.strays.done(jc.id) {
		g.clearStray(jc.id)
	}
}

// clearStray removes job id's mark: no handler of it may act any more.
func (g *Guard) clearStray(id string) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := ledger.ClearStray(ctx, g.store.Pool(), id); err != nil {
		g.cfg.Logger.Warn("keel: could not clear a returned handler's mark; it runs out on its own", "job_id", id, "err", err)
	}
}

// renewStrays keeps the marks of the given-up handlers still running here.
func (g *Guard) renewStrays(ctx context.Context) {
	ids := g.strays.list()
	if len(ids) == 0 {
		return
	}
	rctx, cancel := context.WithTimeout(ctx, g.cfg.Lease/3)
	defer cancel()
	if err := ledger.MarkStrays(rctx, g.store.Pool(), ids, g.cfg.Lease.Milliseconds()); err != nil && ctx.Err() == nil {
		g.stats.ledgerErrs.Add(1)
		g.cfg.Logger.Warn("keel: could not renew the marks of given-up handlers", "jobs", len(ids), "err", err)
	}
}
