package ledger_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/internal/ledger"
)

// A pause is recorded once and audited once; a resume likewise.
func TestPauses(t *testing.T) {
	ctx := context.Background()
	tx, err := big.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx)                                                               //nolint:errcheck
	p := plan(t, func(db ledger.DB) { ledger.PauseQueue(ctx, db, "low", "ops", "why") }) //nolint:errcheck
	usesIndex(t, p, nil)
	p = plan(t, func(db ledger.DB) { ledger.ResumeQueue(ctx, db, "low", "ops", "why") }) //nolint:errcheck
	usesIndex(t, p, nil)

	done, err := ledger.PauseQueue(ctx, tx, "low", "ops:ann", "the warehouse is closed")
	require.NoError(t, err)
	require.True(t, done)
	done, err = ledger.PauseQueue(ctx, tx, "low", "ops:bo", "again")
	require.NoError(t, err)
	require.False(t, done)
	ps, err := ledger.Pauses(ctx, tx)
	require.NoError(t, err)
	require.Len(t, ps, 1)
	require.Equal(t, "ops:ann", ps[0].PausedBy)
	require.Equal(t, "the warehouse is closed", ps[0].Note)
	done, err = ledger.ResumeQueue(ctx, tx, "low", "ops:bo", "open again")
	require.NoError(t, err)
	require.True(t, done)
	done, err = ledger.ResumeQueue(ctx, tx, "low", "ops:bo", "open again")
	require.NoError(t, err)
	require.False(t, done)
	var audited int
	require.NoError(t, tx.QueryRow(ctx, `SELECT count(*) FROM keel_audit WHERE action IN ('pause-queue:low', 'resume-queue:low')`).Scan(&audited))
	require.Equal(t, 2, audited)
}
