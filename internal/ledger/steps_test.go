package ledger_test

import (
	"context"
	"testing"

	"github.com/keeljobs/keel/internal/ledger"
)

// A step's statements read its job and its own row by key.
func TestStepPlans(t *testing.T) {
	ctx := context.Background()
	r := ledger.StepRun{JobID: "j00000020", Name: "charge", Holder: "worker-0", Run: 1}
	for name, call := range map[string]func(db ledger.DB){
		"start":          func(db ledger.DB) { ledger.StartStep(ctx, db, r, true, 10000) },          //nolint:errcheck
		"read":           func(db ledger.DB) { ledger.ReadStep(ctx, db, r.JobID, r.Name) },          //nolint:errcheck
		"take over":      func(db ledger.DB) { ledger.TakeOverStep(ctx, db, r) },                    //nolint:errcheck
		"verified":       func(db ledger.DB) { ledger.StepVerified(ctx, db, r) },                    //nolint:errcheck
		"call again":     func(db ledger.DB) { ledger.CallStepAgain(ctx, db, r, 10000) },            //nolint:errcheck
		"forget":         func(db ledger.DB) { ledger.ForgetStep(ctx, db, r) },                      //nolint:errcheck
		"landed":         func(db ledger.DB) { ledger.StepLanded(ctx, db, r) },                      //nolint:errcheck
		"done":           func(db ledger.DB) { ledger.StepDone(ctx, db, r, []byte(`{}`)) },          //nolint:errcheck
		"not verifiable": func(db ledger.DB) { ledger.StepNotVerifiable(ctx, db, r.JobID, r.Name) }, //nolint:errcheck
	} {
		t.Run(name, func(t *testing.T) {
			usesIndex(t, plan(t, call), []string{"keel_steps_pkey"}, "keel_jobs", "keel_steps")
		})
	}
}
