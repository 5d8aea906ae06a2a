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
		e := deadEvent(j.Death)
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

func deadEvent(d ledger.Death) DeadEvent {
	return DeadEvent{JobID: d.ID, Kind: d.Kind, Queue: d.Queue, BusinessKey: d.BusinessKey, Class: d.Class,
		Error: d.Error, TraceID: d.TraceID, Attempts: d.Attempts}
}

// OwedAlerts returns up to limit deaths whose death hook never returned
// (their worker was killed first), recorded more than grace ago.
func (s *Store) OwedAlerts(ctx context.Context, grace time.Duration, limit int) ([]DeadEvent, error) {
	owed, err := ledger.OwedAlerts(ctx, s.pool, grace, limit, nil)
	if err != nil {
		return nil, Interpret(err)
	}
	events := make([]DeadEvent, len(owed))
	for i, d := range owed {
		events[i] = deadEvent(d)
	}
	return events, nil
}

// AlertsPaid records that the death hook ran for the jobs ids.
func (s *Store) AlertsPaid(ctx context.Context, ids ...string) error {
	return Interpret(ledger.AlertsPaid(ctx, s.pool, ids))
}
