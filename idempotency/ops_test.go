package idempotency_test

import (
	"testing"

	"github.com/hibiken/asynq"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/inspect"
)

// opsOf is the operator API on store's ledger, and on Redis through insp
// when it is not nil.
func opsOf(t testing.TB, store *idempotency.Store, insp *asynq.Inspector) *inspect.Inspector {
	t.Helper()
	ops, err := inspect.New(inspect.Config{Pool: store.Pool(), Asynq: insp})
	require.NoError(t, err)
	return ops
}

// checkReplay is what a replay would make of job id, changing nothing.
func checkReplay(t testing.TB, store *idempotency.Store, id string) (inspect.Outcome, error) {
	t.Helper()
	os, err := opsOf(t, store, nil).Check(t.Context(), inspect.ActionReplay, []string{id})
	if err != nil {
		return inspect.Outcome{}, err
	}
	return os[0], os[0].Err
}

// countUnreplayable counts the dead jobs f matches that a replay refuses.
func countUnreplayable(t testing.TB, store *idempotency.Store, f inspect.Filter) (int, error) {
	t.Helper()
	d, err := opsOf(t, store, nil).DryRunMatching(t.Context(), inspect.ActionReplay, f)
	return d.RefusedTotal(), err
}
