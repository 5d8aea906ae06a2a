package ledger_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/internal/ledger"
)

var someIDs = []string{"j00000007", "j00000019", "j00000031"}

func TestOperatorPlans(t *testing.T) {
	ctx := context.Background()
	p := plan(t, func(db ledger.DB) { ledger.LockJobs(ctx, db, someIDs) }) //nolint:errcheck
	usesIndex(t, p, []string{"keel_jobs_pkey"}, "keel_jobs")
	for _, a := range []ledger.Action{ledger.Replay, ledger.Discard, ledger.Cancel, ledger.ReleaseWaiting} {
		p = plan(t, func(db ledger.DB) { ledger.Judge(ctx, db, a, someIDs) }) //nolint:errcheck
		usesIndex(t, p, []string{"keel_jobs_pkey", "keel_steps_pkey"}, "keel_jobs", "keel_steps")
		p = plan(t, func(db ledger.DB) { ledger.Act(ctx, db, a, someIDs, "ops", "why", nil) }) //nolint:errcheck
		usesIndex(t, p, []string{"keel_jobs_pkey"}, "keel_jobs", "keel_steps")
	}
	p = plan(t, func(db ledger.DB) { ledger.Audit(ctx, db, "j00000007", "show-payload", "ops", "", nil) }) //nolint:errcheck
	usesIndex(t, p, nil)
	p = plan(t, func(db ledger.DB) { ledger.AuditOf(ctx, db, "j00000007") }) //nolint:errcheck
	usesIndex(t, p, []string{"keel_audit_job"}, "keel_audit")
	p = plan(t, func(db ledger.DB) { ledger.Audited(ctx, db, "j00000007", "step-not-happened:charge") }) //nolint:errcheck
	usesIndex(t, p, []string{"keel_audit_job"}, "keel_audit")
	p = plan(t, func(db ledger.DB) { ledger.LockStatus(ctx, db, "j00000007") }) //nolint:errcheck
	usesIndex(t, p, []string{"keel_jobs_pkey"}, "keel_jobs")
	for _, happened := range []bool{true, false} {
		p = plan(t, func(db ledger.DB) { ledger.SettleStep(ctx, db, "j00000007", "charge", happened, nil) }) //nolint:errcheck
		usesIndex(t, p, []string{"keel_steps_pkey"}, "keel_steps")
	}
	p = plan(t, func(db ledger.DB) { ledger.StepStatus(ctx, db, "j00000007", "charge") }) //nolint:errcheck
	usesIndex(t, p, []string{"keel_steps_pkey"}, "keel_steps")
	p = plan(t, func(db ledger.DB) { ledger.JobStatus(ctx, db, "j00000007") }) //nolint:errcheck
	usesIndex(t, p, []string{"keel_jobs_pkey"}, "keel_jobs")
	// A cancel's order probes the primary key per id, whatever the ledger's size.
	p = plan(t, func(db ledger.DB) { ledger.CancelOrder(ctx, db, []string{"j00000007", "j00000008"}) }) //nolint:errcheck
	usesIndex(t, p, []string{"keel_jobs_pkey"}, "keel_jobs")
	p = plan(t, func(db ledger.DB) { ledger.Counts(ctx, db, []string{"kind3"}) }) //nolint:errcheck
	usesIndex(t, p, []string{"keel_jobs_kind_business_key"}, "keel_jobs")
	// Every kind: the whole table, once, as documented.
	p = plan(t, func(db ledger.DB) { ledger.Counts(ctx, db, nil) }) //nolint:errcheck
	usesIndex(t, p, []string{"Aggregate"})
}

// The filters read the dead set by its indexes, the open set by its own.
func TestFilterPlans(t *testing.T) {
	ctx := context.Background()
	week := time.Now().Add(-7 * 24 * time.Hour)
	for _, c := range []struct {
		f  ledger.Filter
		ix string
	}{
		{ledger.Filter{}, "keel_jobs_dead"},
		{ledger.Filter{Kind: "kind3"}, "keel_jobs_dead_kind"},
		{ledger.Filter{Queue: "critical", Class: "permanent", Since: week}, "keel_jobs_dead"},
		{ledger.Filter{Kind: "kind3", Until: week}, "keel_jobs_dead_kind"},
		// Open jobs: of a kind, the kind's range of its index (a quarter
		// of this ledger's jobs are open); otherwise each of their sets by
		// its own index.
		{ledger.Filter{Open: true, Kind: "kind3"}, "keel_jobs_kind_business_key"},
		{ledger.Filter{Open: true, Queue: "critical", Since: week}, "keel_jobs_open"},
		{ledger.Filter{Open: true, Queue: "critical", Since: week}, "keel_jobs_waiting"},
		{ledger.Filter{Open: true, Queue: "critical", Since: week}, "keel_jobs_paused"},
	} {
		p := plan(t, func(db ledger.DB) { ledger.MatchingIDs(ctx, db, c.f) }) //nolint:errcheck
		usesIndex(t, p, []string{c.ix}, "keel_jobs")
		p = plan(t, func(db ledger.DB) { ledger.CountMatching(ctx, db, c.f) }) //nolint:errcheck
		usesIndex(t, p, []string{c.ix}, "keel_jobs")
		p = plan(t, func(db ledger.DB) { ledger.ListMatching(ctx, db, c.f, 50, 0) }) //nolint:errcheck
		usesIndex(t, p, []string{c.ix}, "keel_jobs")
		a := ledger.Replay
		if c.f.Open {
			a = ledger.Cancel
		}
		p = plan(t, func(db ledger.DB) { ledger.CountVerdicts(ctx, db, a, c.f) }) //nolint:errcheck
		// The steps in doubt may be hashed once rather than probed per
		// job, when the planner finds it cheaper for the set matched.
		usesIndex(t, p, []string{c.ix}, "keel_jobs")
	}
}

// The act statements do what the verdicts say, each job once, auditing
// each change beside it.
func TestActFollowsJudge(t *testing.T) {
	ctx := context.Background()
	for _, a := range []ledger.Action{ledger.Replay, ledger.Discard, ledger.Cancel, ledger.ReleaseWaiting} {
		t.Run(string(a), func(t *testing.T) {
			tx, err := big.Begin(ctx)
			require.NoError(t, err)
			defer tx.Rollback(ctx) //nolint:errcheck
			var ids []string
			for g := 1; g <= 600; g++ {
				ids = append(ids, "j"+pad(g))
			}
			for g := 1; g <= 50; g++ {
				ids = append(ids, "a"+pad(g))
			}
			require.NoError(t, ledger.LockJobs(ctx, tx, ids))
			vs, err := ledger.Judge(ctx, tx, a, ids)
			require.NoError(t, err)
			want := map[string]bool{}
			for _, v := range vs {
				if v.Verdict == ledger.VerdictOK {
					want[v.ID] = true
				}
				if v.Verdict == ledger.VerdictDoubt {
					require.NotEmpty(t, v.Doubt)
				}
			}
			require.NotEmpty(t, want)
			done, err := ledger.Act(ctx, tx, a, ids, "ops", "act test", nil)
			require.NoError(t, err)
			got := map[string]bool{}
			for _, x := range done {
				got[x.ID] = true
			}
			require.Equal(t, want, got)
			again, err := ledger.Act(ctx, tx, a, ids, "ops", "act test", nil)
			require.NoError(t, err)
			require.Empty(t, again, "a second time finds nothing to do")
			var audited int
			require.NoError(t, tx.QueryRow(ctx, `SELECT count(*) FROM keel_audit WHERE job_id = ANY($1) AND action = $2 AND actor = 'ops' AND note = 'act test'`,
				ids, string(a)).Scan(&audited))
			require.Equal(t, len(want), audited)
		})
	}
}

func pad(g int) string { return fmt.Sprintf("%08d", g) }
