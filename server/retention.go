package server

import (
	"context"

	"github.com/keeljobs/keel/internal/ledger"
)

// declareRetention records in the ledger the retention policies the
// worker's kinds declare in code (tasks.Keep), replacing what an earlier
// build declared, so that every reconciler (in any process) applies them.
// A person's policy stays in force over them. A failure is logged: the
// kind keeps what the ledger held, and the worker still runs its jobs.
func (s *Server) declareRetention(ctx context.Context) {
	for _, k := range s.cfg.Kinds.All() {
		if err := ledger.DeclareRetention(ctx, s.cfg.Pool, k.Name(), s.cfg.Kinds.Retention(k.Name()), s.guard.Holder()); err != nil {
			s.cfg.Logger.Warn("keel: recording a kind's retention policies failed; the ledger keeps what it held",
				"kind", k.Name(), "err", err)
		}
	}
}
