package executor

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/keeljobs/keel/internal/ledger"
	"github.com/keeljobs/keel/retry"
)

// A handler's progress reports and its result. Both stay in memory until
// they are written: a report at most once an interval per run, the result
// with the run's completion.

const (
	// DefaultProgressInterval is the least time between two progress
	// writes of one run: reports in between are kept in memory, the latest
	// written when the interval is up.
	DefaultProgressInterval = time.Second
	// MaxResultBytes bounds a job's result as JSON.
	MaxResultBytes = 64 << 10
	// MaxProgressNoteBytes bounds a progress report's note; a longer one
	// is cut.
	MaxProgressNoteBytes = 256
)

var (
	// ErrResultTooLarge is idempotency.ErrResultTooLarge.
	ErrResultTooLarge = errors.New("keel: result too large")
	// ErrRunEnded is idempotency.ErrRunEnded.
	ErrRunEnded = errors.New("keel: this run has ended; what it reports is not recorded")
)

// SetResult is idempotency.SetResult.
func SetResult(ctx context.Context, v any) error {
	jc, err := jobFrom(ctx)
	if err != nil {
		return err
	}
	b, err := json.Marshal(v)
	if err != nil {
		return retry.Permanent(fmt.Errorf("keel: job %s: result: %w", jc.id, err))
	}
	if len(b) > MaxResultBytes {
		return retry.Permanent(fmt.Errorf("keel: job %s: result of %d bytes as JSON, at most %d: %w (store large data elsewhere, its id here)",
			jc.id, len(b), MaxResultBytes, ErrResultTooLarge))
	}
	if err := jc.usable(); err != nil {
		return err
	}
	jc.resultMu.Lock()
	defer jc.resultMu.Unlock()
	if jc.resultSealed {
		return retry.Permanent(fmt.Errorf("keel: job %s: result set after its completion was sent: %w", jc.id, ErrAlreadyCompleted))
	}
	jc.result = b
	return nil
}

// sealResult returns the result to write with the completion and refuses
// later SetResults; unsealResult undoes it when the completion was not
// sent.
func (jc *jobContext) sealResult() []byte {
	jc.resultMu.Lock()
	defer jc.resultMu.Unlock()
	jc.resultSealed = true
	return jc.result
}

func (jc *jobContext) unsealResult() {
	jc.resultMu.Lock()
	jc.resultSealed = false
	jc.resultMu.Unlock()
}

// Progress is idempotency.Progress.
func Progress(ctx context.Context, done, total int64, note string) error {
	jc, err := jobFrom(ctx)
	if err != nil {
		return err
	}
	if done < 0 || total < 0 {
		return retry.Permanent(fmt.Errorf("keel: job %s: progress %d/%d: neither may be negative", jc.id, done, total))
	}
	if jc.completed.Load() {
		return fmt.Errorf("keel: job %s: progress after its completing InTx: %w", jc.id, ErrAlreadyCompleted)
	}
	if err := jc.usable(); err != nil {
		return err
	}
	return jc.progress.report(ctx, jc, progressReport{done: done, total: total, note: storableText(note, MaxProgressNoteBytes)})
}

type progressReport struct {
	done, total int64
	note        string
}

// progress coalesces a run's reports: one is written at once when the
// last write is an interval old, else the latest waits for its timer.
// A refusal (the run no longer holds its job) is kept and returned by the
// next report; other errors (the ledger unreachable) are returned once,
// and the next report tries again.
type progress struct {
	mu       sync.Mutex
	pending  *progressReport // the latest not yet written
	last     time.Time       // when the last write was sent
	timer    *time.Timer
	writing  bool
	ended    bool
	refused  error
	inflight sync.WaitGroup
}

func (p *progress) report(ctx context.Context, jc *jobContext, r progressReport) error {
	p.mu.Lock()
	switch {
	case p.ended:
		p.mu.Unlock()
		return fmt.Errorf("keel: job %s: progress after its handler returned: %w", jc.id, ErrRunEnded)
	case p.refused != nil:
		p.mu.Unlock()
		return p.refused
	}
	p.pending = &r
	interval := jc.guard.cfg.ProgressInterval
	if since := time.Since(p.last); p.writing || since < interval {
		if !p.writing {
			p.arm(jc, interval-since)
		}
		p.mu.Unlock()
		return nil
	}
	r = p.take()
	p.mu.Unlock()
	wctx, cancel := context.WithTimeout(ctx, jc.guard.cfg.Lease/3)
	defer cancel()
	err := jc.writeProgress(wctx, r)
	p.written(jc, err)
	return err
}

// arm starts the timer that writes the pending report, unless it runs.
func (p *progress) arm(jc *jobContext, in time.Duration) {
	if p.timer == nil {
		p.timer = time.AfterFunc(in, func() { p.flush(jc) })
	}
}

// take makes the pending report the one being written.
func (p *progress) take() progressReport {
	r := *p.pending
	p.pending, p.writing, p.last = nil, true, time.Now()
	p.inflight.Add(1)
	return r
}

func (p *progress) written(jc *jobContext, err error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.writing = false
	p.inflight.Done()
	if errors.Is(err, ErrLeaseLost) || errors.Is(err, ErrRunGivenUp) || errors.Is(err, ErrCancelled) {
		p.refused, p.pending = err, nil
	}
	if p.pending != nil && !p.ended {
		p.arm(jc, jc.guard.cfg.ProgressInterval-time.Since(p.last))
	}
}

// flush writes the latest report when its interval is up.
func (p *progress) flush(jc *jobContext) {
	p.mu.Lock()
	p.timer = nil
	if p.ended || p.pending == nil || p.writing {
		p.mu.Unlock()
		return
	}
	if jc.completed.Load() || jc.usable() != nil {
		p.pending = nil
		p.mu.Unlock()
		return
	}
	r := p.take()
	p.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), jc.guard.cfg.Lease/3)
	defer cancel()
	err := jc.writeProgress(ctx, r)
	if err != nil && !errors.Is(err, ErrLeaseLost) {
		jc.guard.cfg.Logger.Debug("keel: progress not written", "job_id", jc.id, "err", err)
	}
	p.written(jc, err)
}

// end drops a report not yet written and waits for one being written: the
// run's outcome is recorded after its last progress write, never before.
func (p *progress) end() {
	p.mu.Lock()
	p.ended, p.pending = true, nil
	if p.timer != nil {
		p.timer.Stop()
		p.timer = nil
	}
	p.mu.Unlock()
	p.inflight.Wait()
}

// writeProgress writes r where this run still holds its job.
func (jc *jobContext) writeProgress(ctx context.Context, r progressReport) error {
	g := jc.guard
	g.stats.progressWrites.Add(1)
	ok, err := ledger.WriteProgress(ctx, g.store.Pool(), jc.id, g.cfg.Holder, jc.run, r.done, r.total, r.note)
	if err != nil {
		return jc.refused(ctx, interpretError(err))
	}
	if !ok {
		return jc.refused(ctx, fmt.Errorf("keel: job %s: progress not recorded: %w", jc.id, ErrLeaseLost))
	}
	return nil
}

// ResultOf is idempotency.ResultOf.
func ResultOf(ctx context.Context, jobID string) (ledger.JobResult, error) {
	jc, err := jobFrom(ctx)
	if err != nil {
		return ledger.JobResult{}, err
	}
	return jc.guard.store.Result(ctx, jobID)
}

// ParentResults is idempotency.ParentResults.
func ParentResults(ctx context.Context) ([]ledger.ParentResult, error) {
	jc, err := jobFrom(ctx)
	if err != nil {
		return nil, err
	}
	ps, err := ledger.ParentResults(ctx, jc.guard.store.Pool(), jc.id)
	if err != nil {
		return nil, interpretError(err)
	}
	return ps, nil
}
