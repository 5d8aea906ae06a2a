package executor_test

import (
	"testing"

	"github.com/keeljobs/keel/inspect"
	"github.com/keeljobs/keel/internal/jobstore"
	"github.com/keeljobs/keel/internal/testworker"
)

// checkReplay is what a replay would make of job id, changing nothing.
func checkReplay(t testing.TB, store *jobstore.Store, id string) (inspect.Outcome, error) {
	t.Helper()
	os, err := testworker.Ops(t, store, nil).Check(t.Context(), inspect.ActionReplay, []string{id})
	if err != nil {
		return inspect.Outcome{}, err
	}
	return os[0], os[0].Err
}

// countUnreplayable counts the dead jobs f matches that a replay refuses.
func countUnreplayable(t testing.TB, store *jobstore.Store, f inspect.Filter) (int, error) {
	t.Helper()
	d, err := testworker.Ops(t, store, nil).DryRunMatching(t.Context(), inspect.ActionReplay, f)
	return d.RefusedTotal(), err
}
