package ledger_test

import (
	"context"
	"testing"
	"time"

	"github.com/keeljobs/keel/internal/ledger"
)

// Pruning per kind and the dead letters' bounds stay on their indexes: a
// kind's range of one status, never the whole ledger.
func TestRetentionPlans(t *testing.T) {
	ctx := context.Background()
	day := 24 * time.Hour
	bound := ledger.DeadBound{Kind: "kind3", Keep: 30 * day, MaxCount: 1000, Since: time.Now().Add(-60 * day)}
	p := plan(t, func(db ledger.DB) { ledger.FinishedKinds(ctx, db) }) //nolint:errcheck
	usesIndex(t, p, []string{"keel_jobs_finished_kind"}, "keel_jobs")
	p = plan(t, func(db ledger.DB) { ledger.PruneKind(ctx, db, "kind3", "succeeded", 30*day, 1000, nil) }) //nolint:errcheck
	usesIndex(t, p, []string{"keel_jobs_finished_kind"}, "keel_jobs")
	p = plan(t, func(db ledger.DB) { ledger.NoticeDeadDrops(ctx, db, bound, 1000, nil) }) //nolint:errcheck
	usesIndex(t, p, []string{"keel_jobs_dead_kind"}, "keel_jobs")
	p = plan(t, func(db ledger.DB) { ledger.DropDeadLetters(ctx, db, bound, day, 1000, nil) }) //nolint:errcheck
	usesIndex(t, p, []string{"keel_jobs_dead_kind"}, "keel_jobs")
	p = plan(t, func(db ledger.DB) { ledger.CountDroppable(ctx, db, bound, day, nil) }) //nolint:errcheck
	usesIndex(t, p, []string{"keel_jobs_dead_kind"}, "keel_jobs")
	p = plan(t, func(db ledger.DB) { ledger.DeadToDrop(ctx, db, bound, nil) }) //nolint:errcheck
	usesIndex(t, p, []string{"keel_jobs_dead_kind"}, "keel_jobs")
	p = plan(t, func(db ledger.DB) { ledger.MarkSeen(ctx, db, []string{"j00000001"}, "ops", nil) }) //nolint:errcheck
	usesIndex(t, p, []string{"keel_jobs_pkey"}, "keel_jobs")
	p = plan(t, func(db ledger.DB) { ledger.Retention(ctx, db) }) //nolint:errcheck
	usesIndex(t, p, []string{"keel_retention"})
	p = plan(t, func(db ledger.DB) {
		ledger.SetRetention(ctx, db, ledger.Policy{Kind: "k", Status: "dead", MaxCount: 10}, "ops", "why", nil) //nolint:errcheck
	})
	usesIndex(t, p, []string{"Insert on keel_retention", "Insert on keel_audit"})
	p = plan(t, func(db ledger.DB) { ledger.UnsetRetention(ctx, db, "k", "dead", "ops", "why", nil) }) //nolint:errcheck
	usesIndex(t, p, []string{"Delete on keel_retention", "Insert on keel_audit"})
	p = plan(t, func(db ledger.DB) {
		ledger.DeclareRetention(ctx, db, "k", []ledger.Policy{{Status: "succeeded", Keep: day}}, "w") //nolint:errcheck
	})
	usesIndex(t, p, []string{"Insert on keel_retention"})
}
