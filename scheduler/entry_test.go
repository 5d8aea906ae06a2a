package scheduler_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/scheduler"
)

func TestEntryNext(t *testing.T) {
	at := time.Date(2030, 1, 1, 12, 0, 3, 0, time.UTC)
	for _, tc := range []struct {
		spec, zone string
		want       time.Time
	}{
		{"@every 5s", "", time.Date(2030, 1, 1, 12, 0, 5, 0, time.UTC)},
		// Aligned to the epoch, not to the time asked: all instances agree.
		{"@every 1m", "", time.Date(2030, 1, 1, 12, 1, 0, 0, time.UTC)},
		{"@every 1h", "Asia/Kolkata", time.Date(2030, 1, 1, 13, 0, 0, 0, time.UTC)},
		{"30 * * * * *", "", time.Date(2030, 1, 1, 12, 0, 30, 0, time.UTC)},
		{"*/15 * * * *", "", time.Date(2030, 1, 1, 12, 15, 0, 0, time.UTC)},
		{"@hourly", "", time.Date(2030, 1, 1, 13, 0, 0, 0, time.UTC)},
		{"@daily", "", time.Date(2030, 1, 2, 0, 0, 0, 0, time.UTC)},
		{"@daily", "Europe/Berlin", time.Date(2030, 1, 1, 23, 0, 0, 0, time.UTC)},
		{"0 9 * * *", "Asia/Tokyo", time.Date(2030, 1, 2, 0, 0, 0, 0, time.UTC)},
		{"CRON_TZ=Asia/Tokyo 0 9 * * *", "", time.Date(2030, 1, 2, 0, 0, 0, 0, time.UTC)},
		{"0 0 * * MON", "", time.Date(2030, 1, 7, 0, 0, 0, 0, time.UTC)},
	} {
		e := scheduler.Entry{Name: "e", Spec: tc.spec, TimeZone: tc.zone, Kind: "k"}
		got, err := e.Next(at)
		require.NoError(t, err, tc.spec)
		require.Equal(t, tc.want, got.UTC(), "%s in %q", tc.spec, tc.zone)
	}
}

func TestTickKey(t *testing.T) {
	berlin, err := time.LoadLocation("Europe/Berlin")
	require.NoError(t, err)
	tick := time.Date(2030, 1, 1, 3, 0, 0, 0, berlin)
	require.Equal(t, "cron:nightly-report:2030-01-01T02:00:00Z", scheduler.TickKey("nightly-report", tick))
}

func TestParseMissedTicks(t *testing.T) {
	for s, want := range map[string]scheduler.MissedTicks{"catch-up": scheduler.CatchUp, "skip": scheduler.Skip} {
		got, err := scheduler.ParseMissedTicks(s)
		require.NoError(t, err)
		require.Equal(t, want, got)
		require.Equal(t, s, got.String())
	}
	_, err := scheduler.ParseMissedTicks("all")
	require.Error(t, err)
}
