package testworker

import (
	"testing"

	"github.com/hibiken/asynq"

	"github.com/keeljobs/keel/inspect"
	"github.com/keeljobs/keel/internal/jobstore"
)

// Ops is the operator API on store's ledger, and on Redis through insp
// when it is not nil.
func Ops(t testing.TB, store *jobstore.Store, insp *asynq.Inspector) *inspect.Inspector {
	t.Helper()
	ops, err := inspect.New(inspect.Config{Pool: store.Pool(), Asynq: insp})
	if err != nil {
		t.Fatal(err)
	}
	return ops
}
