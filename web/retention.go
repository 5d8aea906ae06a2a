package web

import (
	"context"
	"fmt"
	"net/http"
	"time"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/inspect"
)

// retentionRow is one kind's policy for one status as the retention page
// shows it.
type retentionRow struct {
	inspect.RetentionPolicy
	// Overridden: the kind's code policy, under a person's.
	Overridden bool
}

// Policy says the row's policy in words.
func (r retentionRow) Policy() string {
	s := "kept for ever"
	if r.Keep > 0 {
		s = "kept " + keepText(r.Keep)
	}
	if r.MaxCount > 0 {
		s += fmt.Sprintf(", at most %d (the oldest seen go)", r.MaxCount)
	}
	return s
}

func keepText(d time.Duration) string {
	if d%(24*time.Hour) == 0 {
		return fmt.Sprintf("%d days", d/(24*time.Hour))
	}
	return d.String()
}

// retention shows, read-only, the retention policy in force per kind and
// status, who set it and why; `keel retention set` changes them.
func (s *Server) retention(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), pageTimeout)
	defer cancel()
	ps, err := s.ops.Retention(ctx)
	if err != nil {
		s.ledgerError(w, r, err)
		return
	}
	rows := make([]retentionRow, 0, len(ps))
	for _, p := range ps {
		in, _ := inspect.RetentionInForce(ps, p.Kind, p.Status)
		rows = append(rows, retentionRow{RetentionPolicy: p, Overridden: in.Source != p.Source})
	}
	s.render(w, r, http.StatusOK, "retention", view{Title: "Retention", Nav: "retention", Data: rows})
}

// markSeen records that the person viewing dead letter j's page has seen
// it: only seen dead letters are ever dropped by their kind's bounds. A
// failed write costs a log line, not the page.
func (s *Server) markSeen(ctx context.Context, r *http.Request, j idempotency.Job) {
	p := principalFrom(r.Context())
	if j.Status != idempotency.StatusDead || p == nil || p.Name == "" {
		return
	}
	if _, err := s.ops.MarkSeen(ctx, []string{j.ID}, p.Name); err != nil {
		s.cfg.Logger.Warn("keel web: recording that a dead letter was seen failed", "job_id", j.ID, "err", err)
	}
}
