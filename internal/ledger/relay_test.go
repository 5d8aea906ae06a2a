package ledger_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/internal/ledger"
)

func TestRelayPlans(t *testing.T) {
	ctx := context.Background()
	p := plan(t, func(db ledger.DB) { ledger.ClaimUnpublished(ctx, db, 200, nil) }) //nolint:errcheck
	usesIndex(t, p, []string{"keel_jobs_unpublished"})
	lacks(t, p, "keel_jobs_open")
	p = plan(t, func(db ledger.DB) { ledger.ClaimOutbox(ctx, db, 200, 0, nil) }) //nolint:errcheck
	usesIndex(t, p, []string{"keel_outbox"}, "keel_jobs")
	lacks(t, p, "Bitmap")
	// The idle poll's probe reads the index: a scan of the table would step
	// over every row deleted since it was last vacuumed.
	p = plan(t, func(db ledger.DB) { ledger.OutboxDue(ctx, db) }) //nolint:errcheck
	usesIndex(t, p, []string{"keel_outbox_queued_at"})
	lacks(t, p, "Seq Scan")
	p = plan(t, func(db ledger.DB) { ledger.RelayBacklog(ctx, db, nil) }) //nolint:errcheck
	usesIndex(t, p, []string{"keel_jobs_unpublished"}, "keel_jobs")
	p = plan(t, func(db ledger.DB) { ledger.InOutbox(ctx, db, "j00000001") }) //nolint:errcheck
	usesIndex(t, p, []string{"keel_outbox_pkey"}, "keel_outbox")
	p = plan(t, func(db ledger.DB) { ledger.Unpublish(ctx, db, []string{"j00000001", "j00000002"}) }) //nolint:errcheck
	usesIndex(t, p, []string{"Index Cond: (id = ANY"}, "keel_jobs")
}

// The relay's statements do what the relay counts on, on the big ledger.
func TestRelayClaims(t *testing.T) {
	ctx := context.Background()
	tx, err := big.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck
	var outbox, unpublished int64
	require.NoError(t, tx.QueryRow(ctx, `SELECT (SELECT count(*) FROM keel_outbox), (SELECT count(*) FROM keel_jobs
		WHERE published_at IS NULL AND status IN ('pending', 'failed') AND run_at <= now())`).Scan(&outbox, &unpublished))
	n, oldest, err := ledger.RelayBacklog(ctx, tx, nil)
	require.NoError(t, err)
	require.Equal(t, outbox+unpublished, n)
	require.Greater(t, oldest, time.Duration(0))

	due, err := ledger.OutboxDue(ctx, tx)
	require.NoError(t, err)
	require.True(t, due)
	// The outbox rows of the fixture are a second old: none has waited a
	// minute.
	jobs, taken, err := ledger.ClaimOutbox(ctx, tx, 10, time.Minute, nil)
	require.NoError(t, err)
	require.Zero(t, taken)
	require.Empty(t, jobs)
	jobs, taken, err = ledger.ClaimOutbox(ctx, tx, 10, time.Minute, ledger.At(time.Now().Add(2*time.Minute)))
	require.NoError(t, err)
	require.Equal(t, 10, taken, "two minutes on, they have")
	require.Len(t, jobs, 10)
	jobs, taken, err = ledger.ClaimOutbox(ctx, tx, 10, 0, nil)
	require.NoError(t, err)
	require.Equal(t, 10, taken)
	require.LessOrEqual(t, len(jobs), taken)
	for _, j := range jobs {
		in, err := ledger.InOutbox(ctx, tx, j.ID)
		require.NoError(t, err)
		require.False(t, in, "taken off the outbox")
		require.Equal(t, ledger.StatusPending, j.Status)
		require.NotEmpty(t, j.Kind)
	}

	// Written unpublished up to 90 hours ago: none was due 100 hours ago.
	claimed, err := ledger.ClaimUnpublished(ctx, tx, 5, ledger.At(time.Now().Add(-100*time.Hour)))
	require.NoError(t, err)
	require.Empty(t, claimed)
	claimed, err = ledger.ClaimUnpublished(ctx, tx, 5, nil)
	require.NoError(t, err)
	require.Len(t, claimed, 5)
	ids := []string{claimed[0].ID, claimed[1].ID}
	for _, j := range claimed {
		require.NotNil(t, j.PublishedAt)
	}
	require.NoError(t, ledger.Unpublish(ctx, tx, ids))
	n2, _, err := ledger.RelayBacklog(ctx, tx, nil)
	require.NoError(t, err)
	require.Equal(t, n-20-5+2, n2, "the claims left the backlog, the two handed back are in it again")
	// An hour on, the oldest has waited an hour longer.
	_, later, err := ledger.RelayBacklog(ctx, tx, ledger.At(time.Now().Add(time.Hour)))
	require.NoError(t, err)
	require.Greater(t, later, oldest+59*time.Minute)
}

// The relay's locks are held by one session at a time.
func TestRelayLocks(t *testing.T) {
	ctx := context.Background()
	a, err := big.Acquire(ctx)
	require.NoError(t, err)
	defer a.Release()
	b, err := big.Acquire(ctx)
	require.NoError(t, err)
	defer b.Release()
	require.NoError(t, ledger.LockRelayAwake(ctx, a))
	held, err := ledger.RelayAwakeHeld(ctx, b)
	require.NoError(t, err)
	require.True(t, held)
	held, err = ledger.RelayAwakeHeld(ctx, a)
	require.NoError(t, err)
	require.False(t, held, "a session does not count its own lock")
	got, err := ledger.TryRelayLock(ctx, b, ledger.RelayAwakeLock)
	require.NoError(t, err)
	require.False(t, got)
	got, err = ledger.TryRelayLock(ctx, b, ledger.RelaySettleLock)
	require.NoError(t, err)
	require.True(t, got)
	ok, err := ledger.UnlockRelay(ctx, a, ledger.RelayAwakeLock)
	require.NoError(t, err)
	require.True(t, ok)
	ok, err = ledger.UnlockRelay(ctx, b, ledger.RelaySettleLock)
	require.NoError(t, err)
	require.True(t, ok)
	ok, err = ledger.UnlockRelay(ctx, b, ledger.RelaySettleLock)
	require.NoError(t, err)
	require.False(t, ok, "not held any more")
	require.NoError(t, ledger.ListenRelay(ctx, a))
	_, err = a.Exec(ctx, "UNLISTEN *")
	require.NoError(t, err)
}
