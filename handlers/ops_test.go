package handlers_test

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
