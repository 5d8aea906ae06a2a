package ledger_test

import (
	"context"
	"testing"

	"github.com/keeljobs/keel/internal/ledger"
)

// A dependency is found from either end by an index, however large the
// ledger and however many jobs wait.
func TestDependencyPlans(t *testing.T) {
	ctx := context.Background()
	one := ledger.JobInsert{ID: "new1", Kind: "kind1", BusinessKey: "new-key", Queue: "default", Payload: []byte(`{}`)}
	for name, c := range map[string]struct {
		call    func(db ledger.DB)
		indexes []string
	}{
		"lock parents by id": {func(db ledger.DB) {
			ledger.LockParents(ctx, db, []string{"j00000007", "j00000014"}, []string{}, []string{}) //nolint:errcheck
		}, []string{"keel_jobs_pkey"}},
		"lock parents by key": {func(db ledger.DB) {
			ledger.LockParents(ctx, db, []string{}, []string{"kind1"}, []string{"key1"}) //nolint:errcheck
		}, []string{"keel_jobs_kind_business_key"}},
		"insert waiting": {func(db ledger.DB) {
			ledger.InsertWaiting(ctx, db, one, ledger.Waiting{Parents: []string{"j00000007"}, WaitingOn: 1}) //nolint:errcheck
		}, []string{"keel_jobs_kind_business_key"}},
		"parents":        {func(db ledger.DB) { ledger.ParentsOf(ctx, db, "a00000001") }, []string{"keel_job_deps_child", "keel_jobs_pkey"}},     //nolint:errcheck
		"children":       {func(db ledger.DB) { ledger.ChildrenOf(ctx, db, "j00000007") }, []string{"keel_job_deps_pkey", "keel_jobs_pkey"}},     //nolint:errcheck
		"parent results": {func(db ledger.DB) { ledger.ParentResults(ctx, db, "a00000001") }, []string{"keel_job_deps_child", "keel_jobs_pkey"}}, //nolint:errcheck
		"workflow":       {func(db ledger.DB) { ledger.Workflow(ctx, db, "wf3") }, []string{"keel_jobs_workflow", "keel_job_deps_child"}},        //nolint:errcheck
		"parents page": {func(db ledger.DB) {
			ledger.ParentsPage(ctx, db, "a00000001", 100) //nolint:errcheck
		}, []string{"keel_job_deps_child", "keel_jobs_pkey"}},
		"children page": {func(db ledger.DB) {
			ledger.ChildrenPage(ctx, db, "j00000007", 100) //nolint:errcheck
		}, []string{"keel_job_deps_pkey", "keel_jobs_pkey"}},
	} {
		t.Run(name, func(t *testing.T) {
			usesIndex(t, plan(t, c.call), c.indexes, "keel_jobs", "keel_job_deps")
		})
	}
	// A page of a parent's children reads them in key order up to its
	// LIMIT, rather than sorting them all.
	lacks(t, plan(t, func(db ledger.DB) { ledger.ChildrenPage(ctx, db, "j00000007", 100) }), "Sort") //nolint:errcheck
}
