package ledger_test

import (
	"context"
	"testing"
	"time"

	"github.com/keeljobs/keel/internal/ledger"
)

// Writing and reading jobs goes by key or id, however large the ledger.
func TestJobPlans(t *testing.T) {
	ctx := context.Background()
	ids := []string{"j00000020", "j00000032"}
	one := ledger.JobInsert{ID: "new1", Kind: "kind1", BusinessKey: "new-key", Queue: "default", Payload: []byte(`{}`)}
	rows := ledger.JobRows{IDs: []string{"new1"}, Kinds: []string{"kind1"}, Keys: []string{"new-key"}, Queues: []string{"default"},
		Payloads: [][]byte{[]byte(`{}`)}, MaxRetry: []int32{3}, Timeouts: []int64{0}, MaxWaits: []int64{0},
		Deadlines: []*time.Time{nil}, RunAts: []*time.Time{nil}, Summaries: []string{""}, Traces: []string{""},
		TraceParents: []string{}, TraceStates: []string{}, Batches: []string{""}, Expire: []bool{false}}
	for name, c := range map[string]struct {
		call    func(db ledger.DB)
		indexes []string
	}{
		"insert":       {func(db ledger.DB) { ledger.InsertJob(ctx, db, one, false) }, []string{"keel_jobs_kind_business_key"}},  //nolint:errcheck
		"insert, wake": {func(db ledger.DB) { ledger.InsertJob(ctx, db, one, true) }, []string{"keel_jobs_kind_business_key"}},   //nolint:errcheck
		"insert many":  {func(db ledger.DB) { ledger.InsertJobs(ctx, db, rows, false, true, nil, func(ledger.NewRow) {}) }, nil}, //nolint:errcheck
		"insert batched": {func(db ledger.DB) {
			ledger.InsertJobs(ctx, db, rows, false, true, []string{"b10"}, func(ledger.NewRow) {})
		}, []string{"keel_batches_pkey"}}, //nolint:errcheck
		"lookup many": {func(db ledger.DB) {
			ledger.LookupJobs(ctx, db, []string{"kind1"}, []string{"key1"}, func(ledger.Job) {})
		}, []string{"keel_jobs_kind_business_key"}}, //nolint:errcheck
		"supersede":      {func(db ledger.DB) { ledger.Supersede(ctx, db, []string{"kind1"}, []string{"key1"}, []int64{1000}) }, []string{"keel_jobs_kind_business_key"}}, //nolint:errcheck
		"get":            {func(db ledger.DB) { ledger.GetJob(ctx, db, ids[0]) }, []string{"keel_jobs_pkey"}},                                                             //nolint:errcheck
		"get many":       {func(db ledger.DB) { ledger.GetJobs(ctx, db, ids) }, []string{"keel_jobs_pkey"}},                                                               //nolint:errcheck
		"lookup":         {func(db ledger.DB) { ledger.LookupJob(ctx, db, "kind1", "key1") }, []string{"keel_jobs_kind_business_key"}},                                    //nolint:errcheck
		"finished among": {func(db ledger.DB) { ledger.FinishedAmong(ctx, db, ids) }, []string{"keel_jobs_pkey"}},                                                         //nolint:errcheck
		"steps of":       {func(db ledger.DB) { ledger.StepsOf(ctx, db, ids) }, []string{"keel_steps_pkey"}},                                                              //nolint:errcheck
		"mark published": {func(db ledger.DB) { ledger.MarkPublished(ctx, db, ids) }, []string{"keel_jobs_pkey"}},                                                         //nolint:errcheck
	} {
		t.Run(name, func(t *testing.T) {
			usesIndex(t, plan(t, c.call), c.indexes, "keel_jobs", "keel_steps", "keel_batches")
		})
	}
}
