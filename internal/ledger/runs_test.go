package ledger_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/internal/ledger"
)

func TestRunPlans(t *testing.T) {
	ctx := context.Background()
	ids := []string{"j00000008", "j00000020"}
	for name, call := range map[string]func(db ledger.DB){
		"solo":        func(db ledger.DB) { ledger.MarkSolo(ctx, db, ids[0], "worker-0", 1) },            //nolint:errcheck
		"holder":      func(db ledger.DB) { ledger.Holder(ctx, db, ids[0]) },                             //nolint:errcheck
		"mark strays": func(db ledger.DB) { ledger.MarkStrays(ctx, db, ids, 10000) },                     //nolint:errcheck
		"clear stray": func(db ledger.DB) { ledger.ClearStray(ctx, db, ids[0]) },                         //nolint:errcheck
		"deadlines":   func(db ledger.DB) { ledger.EndPastDeadline(ctx, db, ids, time.Second, "", nil) }, //nolint:errcheck
		"run fates":   func(db ledger.DB) { ledger.RunFates(ctx, db, ids) },                              //nolint:errcheck
		"cancelled":   func(db ledger.DB) { ledger.Cancelled(ctx, db, ids[0]) },                          //nolint:errcheck
		"renew flights": func(db ledger.DB) {
			ledger.RenewFlights(ctx, db, "worker-0", 10000, ids, []string{"charge", "charge"}, []int32{1, 1})
		}, //nolint:errcheck
	} {
		t.Run(name, func(t *testing.T) {
			usesIndex(t, plan(t, call), []string{"Index"}, "keel_jobs", "keel_steps")
		})
	}
}

// A deadline is judged by the time the statement is given: tests move it.
func TestEndPastDeadlineByNow(t *testing.T) {
	ctx := context.Background()
	tx, err := big.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck
	id := "j00000679"      // pending, its deadline an hour away (see fill)
	ended, err := ledger.EndPastDeadline(ctx, tx, []string{id}, 0, "", nil)
	require.NoError(t, err)
	require.Empty(t, ended, "its deadline has not passed")
	ended, err = ledger.EndPastDeadline(ctx, tx, []string{id}, 0, "", ledger.At(time.Now().Add(2*time.Hour)))
	require.NoError(t, err)
	require.Len(t, ended, 1)
	require.Equal(t, ledger.StatusDead, ended[0].Status)
	require.Equal(t, "deadline", ended[0].Class)
	require.Contains(t, ended[0].Error, "its deadline")
}
