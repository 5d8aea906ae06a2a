package web

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/hibiken/asynq"

	"github.com/keeljobs/keel/metrics"
)

// sample is one reading of a queue's counters.
type sample struct {
	At                time.Time
	Processed, Failed int // asynq's cumulative counters
	Pending, Active   int
	Latency           time.Duration
}

// ring keeps the last SamplePoints samples of one queue.
type ring struct {
	pts  [SamplePoints]sample
	head int // next slot to write
	n    int
}

func (r *ring) add(s sample) {
	r.pts[r.head] = s
	r.head = (r.head + 1) % len(r.pts)
	r.n = min(r.n+1, len(r.pts))
}

// all returns the samples oldest first.
func (r *ring) all() []sample {
	out := make([]sample, 0, r.n)
	start := (r.head - r.n + len(r.pts)) % len(r.pts)
	for i := range r.n {
		out = append(out, r.pts[(start+i)%len(r.pts)])
	}
	return out
}

// sampler reads every queue's counters at an interval, so the overview can
// chart the last hour without Prometheus. Each web server keeps its own
// history, from its start.
type sampler struct {
	insp     *asynq.Inspector
	interval time.Duration
	log      *slog.Logger

	mu    sync.Mutex
	rings map[string]*ring

	stop context.CancelFunc
	done chan struct{}
}

func startSampler(insp *asynq.Inspector, interval time.Duration, log *slog.Logger) *sampler {
	ctx, cancel := context.WithCancel(context.Background())
	s := &sampler{insp: insp, interval: interval, log: log, rings: map[string]*ring{}, stop: cancel, done: make(chan struct{})}
	go s.run(ctx)
	return s
}

func (s *sampler) run(ctx context.Context) {
	defer close(s.done)
	t := time.NewTicker(s.interval)
	defer t.Stop()
	for {
		s.tick()
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

func (s *sampler) tick() {
	qs, err := metrics.ReadQueues(s.insp)
	if err != nil {
		s.log.Debug("keel web: sampling queues failed", "err", err)
		return
	}
	now := time.Now()
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, q := range qs {
		r := s.rings[q.Name]
		if r == nil {
			r = &ring{}
			s.rings[q.Name] = r
		}
		r.add(sample{At: now, Processed: q.ProcessedTotal, Failed: q.FailedTotal,
			Pending: q.Size["pending"], Active: q.Size["active"], Latency: q.OldestPending})
	}
}

func (s *sampler) series(queue string) []sample {
	s.mu.Lock()
	defer s.mu.Unlock()
	if r := s.rings[queue]; r != nil {
		return r.all()
	}
	return nil
}

func (s *sampler) close() {
	s.stop()
	<-s.done
}

// ratePoint is a per-minute rate between two samples.
type ratePoint struct {
	At                time.Time
	Processed, Failed float64
}

// rates turns cumulative samples into per-minute rates. A counter that went
// down (Redis was flushed) counts as zero for that interval.
func rates(ss []sample) []ratePoint {
	var out []ratePoint
	for i := 1; i < len(ss); i++ {
		a, b := ss[i-1], ss[i]
		mins := b.At.Sub(a.At).Minutes()
		if mins <= 0 {
			continue
		}
		out = append(out, ratePoint{At: b.At,
			Processed: float64(max(b.Processed-a.Processed, 0)) / mins,
			Failed:    float64(max(b.Failed-a.Failed, 0)) / mins})
	}
	return out
}
