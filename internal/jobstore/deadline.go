package jobstore

import (
	"context"
	"time"

	"github.com/keeljobs/keel/internal/ledger"
)

// EndPastDeadlineWithin ends the jobs ids whose deadline comes within margin
// (see ledger.EndPastDeadline) and returns the deaths and the expired among
// them.
func (s *Store) EndPastDeadlineWithin(ctx context.Context, ids []string, margin time.Duration, summary string) (deaths, expired []DeadEvent, err error) {
	ended, err := ledger.EndPastDeadline(ctx, s.pool, ids, margin, StorableText(summary, MaxErrorBytes), nil)
	if err != nil {
		return nil, nil, Interpret(err)
	}
	for _, j := range ended {
		e := DeadEvent{JobID: j.ID, Kind: j.Kind, Queue: j.Queue, BusinessKey: j.BusinessKey, Class: j.Class,
			Error: j.Error, TraceID: j.TraceID, Attempts: j.Attempts}
		if j.Status == ledger.StatusDead {
			deaths = append(deaths, e)
		} else {
			expired = append(expired, e)
		}
	}
	return deaths, expired, nil
}

// EndPastDeadline ends those of jobs ids whose deadline has passed while
// no run holds them (the reconciler calls it before it would publish them
// again: asynq would only fail them unrun). It returns the deaths, for the
// caller's alerts, and the jobs that expired (class expired).
func (s *Store) EndPastDeadline(ctx context.Context, ids []string) (deaths, expired []DeadEvent, err error) {
	return s.EndPastDeadlineWithin(ctx, ids, 0, "")
}
