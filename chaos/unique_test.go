package chaos_test

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/keeljobs/keel/inspect"
)

// uniqueScenario plays one key of a Unique kind: its first job starts, and
// its handler acts on past its run — the driver cancels the job
// (uniqueCancelKind) or keel gives the run up at its timeout
// (uniqueTimeoutKind). Once the first job has ended, the window has passed
// and a second job of the key is enqueued: it must be a new job, and must
// not start while the first job's handler still acts (chaos_key_runs).
func (d *driver) uniqueScenario(ctx context.Context, s submission) {
	fail := func(format string, args ...any) {
		d.mu.Lock()
		d.keys[s.key].scenarioErr = fmt.Sprintf(format, args...)
		d.mu.Unlock()
	}
	first := s
	first.gen = 1
	d.submitOne(ctx, first)
	d.mu.Lock()
	var firstID string
	for id := range d.keys[s.key].jobIDs {
		firstID = id
	}
	d.mu.Unlock()
	if firstID == "" {
		return // never accepted: the run ended first
	}
	if !d.waitLedger(ctx, `SELECT count(*) > 0 FROM chaos_key_runs WHERE job_id = $1`, firstID) {
		fail("the first job %s never started before the run's deadline", firstID)
		return
	}
	if s.class == uniqueCancel {
		for try := 0; ; try++ {
			_, err := d.client.Cancel(ctx, firstID)
			if err == nil || errors.Is(err, inspect.ErrNotCancellable) {
				if err != nil {
					// It ended before the cancel (a kill, then a run):
					// the key is still played, without a cancel.
					d.note(fmt.Sprintf("unique scenario %s: %v", s.key, err))
				}
				break
			}
			if ctx.Err() != nil || try == 20 {
				fail("cancel %s: %v", firstID, err)
				return
			}
			_ = pause(ctx, 200*time.Millisecond)
		}
	}
	if !d.waitLedger(ctx, `SELECT status IN `+terminal+` FROM keel_jobs WHERE id = $1`, firstID) {
		fail("the first job %s did not end before the run's deadline", firstID)
		return
	}
	second := s
	second.gen = 2
	for {
		res, err := d.submit(ctx, second)
		if err == nil {
			d.mu.Lock()
			rec := d.keys[s.key]
			rec.firstID = firstID
			rec.jobIDs = map[string]bool{res.Job.ID: true}
			rec.nextExisted = res.Existed
			rec.nextAt = res.Job.CreatedAt
			d.mu.Unlock()
			return
		}
		if ctx.Err() != nil {
			fail("the second job was never accepted: %v", err)
			return
		}
		_ = pause(ctx, 200*time.Millisecond)
	}
}

// waitLedger polls a query answering one boolean until it is true, or
// until ctx (the run's deadline) ends: in the long soak's backlog a job may
// wait minutes for its first run.
func (d *driver) waitLedger(ctx context.Context, query string, args ...any) bool {
	for {
		var ok bool
		if err := d.pool.QueryRow(ctx, query, args...).Scan(&ok); err == nil && ok {
			return true
		}
		if pause(ctx, 50*time.Millisecond) != nil {
			return false
		}
	}
}
