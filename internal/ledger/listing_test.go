package ledger_test

import (
	"context"
	"testing"

	"github.com/keeljobs/keel/internal/ledger"
)

func TestListJobsPlans(t *testing.T) {
	ctx := context.Background()
	for _, c := range []struct {
		name    string
		f       ledger.JobFilter
		indexes []string
	}{
		{"every job", ledger.JobFilter{}, []string{"keel_jobs_pkey"}},
		{"every job, oldest after a cursor", ledger.JobFilter{Oldest: true, After: "j00030000"}, []string{"keel_jobs_pkey"}},
		{"pending", ledger.JobFilter{Status: "pending"}, []string{"keel_jobs_open"}},
		{"failed after a cursor", ledger.JobFilter{Status: "failed", After: "j00030000"}, []string{"keel_jobs_open"}},
		// A status of many rows walks the primary key and stops after the page.
		{"dead", ledger.JobFilter{Status: "dead"}, []string{"keel_jobs_pkey"}},
		{"succeeded", ledger.JobFilter{Status: "succeeded"}, []string{"keel_jobs_pkey"}},
		{"kind and key prefix", ledger.JobFilter{Kind: "kind3", Prefix: "key12"}, []string{"keel_jobs_kind_business_key"}},
		{"batch", ledger.JobFilter{Batch: "b77"}, []string{"keel_jobs_batch"}},
		// The steps in doubt are hashed once; the jobs walk the primary key.
		{"in doubt", ledger.JobFilter{InDoubt: true}, []string{"keel_jobs_pkey"}},
		{"error", ledger.JobFilter{Error: "BOOM 1"}, []string{"keel_jobs_pkey"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			p := plan(t, func(db ledger.DB) { ledger.ListJobs(ctx, db, c.f, 50) }) //nolint:errcheck
			usesIndex(t, p, c.indexes, "keel_jobs")
		})
	}
}
