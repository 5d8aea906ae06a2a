package ledger_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/internal/ledger"
)

func TestSchedulePlans(t *testing.T) {
	ctx := context.Background()
	now := time.Now()
	p := plan(t, func(db ledger.DB) {
		ledger.LoadSchedule(ctx, db, []string{"entry1", "entry2", "new"}, []time.Time{now, now, now}) //nolint:errcheck
	})
	usesIndex(t, p, []string{"keel_schedule_pkey"}, "keel_schedule")
	p = plan(t, func(db ledger.DB) { ledger.MarkTick(ctx, db, "entry7", now) }) //nolint:errcheck
	usesIndex(t, p, []string{"Arbiter Indexes: keel_schedule_pkey"})
}

// A loaded entry without a row gets one at the time given; a tick never
// moves back.
func TestScheduleTicks(t *testing.T) {
	ctx := context.Background()
	tx, err := big.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck
	t0 := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	got, err := ledger.LoadSchedule(ctx, tx, []string{"a"}, []time.Time{t0})
	require.NoError(t, err)
	require.Empty(t, got, "the row is created, not returned")
	got, err = ledger.LoadSchedule(ctx, tx, []string{"a"}, []time.Time{t0.Add(time.Hour)})
	require.NoError(t, err)
	require.True(t, got["a"].Equal(t0), got)
	require.NoError(t, ledger.MarkTick(ctx, tx, "a", t0.Add(2*time.Minute)))
	require.NoError(t, ledger.MarkTick(ctx, tx, "a", t0.Add(time.Minute)))
	got, err = ledger.LoadSchedule(ctx, tx, []string{"a"}, []time.Time{t0})
	require.NoError(t, err)
	require.True(t, got["a"].Equal(t0.Add(2*time.Minute)), got)
}
