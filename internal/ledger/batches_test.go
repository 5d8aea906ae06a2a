package ledger_test

import (
	"context"
	"testing"

	"github.com/keeljobs/keel/internal/ledger"
)

func TestBatchPlans(t *testing.T) {
	ctx := context.Background()
	for name, c := range map[string]struct {
		call    func(db ledger.DB)
		indexes []string
	}{
		"get":      {func(db ledger.DB) { ledger.GetBatch(ctx, db, "b10") }, []string{"keel_batches_pkey"}},            //nolint:errcheck
		"list":     {func(db ledger.DB) { ledger.ListBatches(ctx, db, false, 100) }, []string{"keel_batches_created"}}, //nolint:errcheck
		"open":     {func(db ledger.DB) { ledger.ListBatches(ctx, db, true, 100) }, []string{"keel_batches_"}},         //nolint:errcheck
		"statuses": {func(db ledger.DB) { ledger.BatchStatuses(ctx, db, "b10") }, []string{"keel_jobs_batch"}},         //nolint:errcheck
		"members":  {func(db ledger.DB) { ledger.OpenMembers(ctx, db, "b10", 100) }, []string{"keel_jobs_batch"}},      //nolint:errcheck
		"create":   {func(db ledger.DB) { ledger.CreateBatch(ctx, db, "bx", "", nil, nil) }, nil},                      //nolint:errcheck
	} {
		t.Run(name, func(t *testing.T) {
			usesIndex(t, plan(t, c.call), c.indexes, "keel_jobs", "keel_batches")
		})
	}
}
