package ledger_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/internal/ledger"
)

func TestSessionPlans(t *testing.T) {
	ctx := context.Background()
	p := plan(t, func(db ledger.DB) { ledger.SessionEnded(ctx, db, "s1") }) //nolint:errcheck
	usesIndex(t, p, []string{"keel_web_sessions_ended_pkey"}, "keel_web_sessions_ended")
	// Each sign-out sweeps the few rows whose cookies expired since the last.
	p = plan(t, func(db ledger.DB) { ledger.EndSession(ctx, db, "s9", time.Now(), nil) }) //nolint:errcheck
	usesIndex(t, p, []string{"keel_web_sessions_ended_expiry", "Arbiter Indexes: keel_web_sessions_ended_pkey"}, "keel_web_sessions_ended")
}

// Expired sign-outs go when the next one is recorded, by the time given.
func TestEndSessionDropsExpiredByNow(t *testing.T) {
	ctx := context.Background()
	tx, err := big.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck
	t0 := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	require.NoError(t, ledger.EndSession(ctx, tx, "a", t0.Add(time.Hour), ledger.At(t0)))
	ended, err := ledger.SessionEnded(ctx, tx, "a")
	require.NoError(t, err)
	require.True(t, ended)
	require.NoError(t, ledger.EndSession(ctx, tx, "b", t0.Add(3*time.Hour), ledger.At(t0.Add(2*time.Hour))))
	ended, err = ledger.SessionEnded(ctx, tx, "a")
	require.NoError(t, err)
	require.False(t, ended, "a's cookie expired before b's sign-out was recorded")
}
