package cronspec

import (
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestRecentTicks(t *testing.T) {
	at := func(m int) time.Time { return time.Date(2030, 1, 1, 0, m, 0, 0, time.UTC) }
	min := Every(time.Minute)
	now := at(10).Add(30 * time.Second)

	ticks, more := RecentTicks(min, at(0), now, 3)
	require.Equal(t, []time.Time{at(8), at(9), at(10)}, ticks)
	require.True(t, more)

	ticks, more = RecentTicks(min, at(0), now, 20)
	require.Len(t, ticks, 10)
	require.Equal(t, at(1), ticks[0])
	require.False(t, more)

	ticks, more = RecentTicks(min, at(9), now, 3)
	require.Equal(t, []time.Time{at(10)}, ticks)
	require.False(t, more)

	ticks, _ = RecentTicks(min, now, now, 3)
	require.Empty(t, ticks)

	// A dense entry left a year behind costs a few steps, not millions.
	start := time.Now()
	sec := Every(time.Second)
	ticks, more = RecentTicks(sec, now.AddDate(-1, 0, 0), now, 2)
	require.Equal(t, []time.Time{now.Add(-time.Second), now}, ticks)
	require.True(t, more)
	// Stepping a year of seconds would take many seconds, far above this
	// bound even on a slow host under the race detector.
	require.Less(t, time.Since(start), 2*time.Second)

	// Same for a cron spec: a second-level spec, far behind.
	spec, err := Parse("* * * * * *", time.UTC, false)
	require.NoError(t, err)
	ticks, more = RecentTicks(spec, now.AddDate(0, -1, 0), now, 1)
	require.Equal(t, []time.Time{now}, ticks)
	require.True(t, more)
}

func berlin(t *testing.T) *time.Location {
	t.Helper()
	loc, err := time.LoadLocation("Europe/Berlin")
	require.NoError(t, err)
	return loc
}

func utc(mo time.Month, d, h, m int) time.Time { return time.Date(2030, mo, d, h, m, 0, 0, time.UTC) }

func ticksBetween(sch Schedule, from, to time.Time) []time.Time {
	var out []time.Time
	for t := sch.Next(from); !t.After(to); t = sch.Next(t) {
		out = append(out, t)
	}
	return out
}

// In 2030 Berlin moves to summer time on 31 March and back on 27 October,
// both at 01:00 UTC.
func TestLocalTimesTickOnceAcrossDaylightSaving(t *testing.T) {
	loc := berlin(t)
	nightly, err := Parse("30 2 * * *", loc, true)
	require.NoError(t, err)
	// 02:30 does not exist on 31 March: it ticks at 03:30 summer time.
	require.Equal(t, []time.Time{utc(3, 30, 1, 30), utc(3, 31, 1, 30), utc(4, 1, 0, 30)},
		ticksBetween(nightly, utc(3, 30, 0, 0), utc(4, 1, 12, 0)))
	// 02:30 happens twice on 27 October: it ticks at the first.
	require.Equal(t, []time.Time{utc(10, 26, 0, 30), utc(10, 27, 0, 30), utc(10, 28, 1, 30)},
		ticksBetween(nightly, utc(10, 26, 0, 0), utc(10, 28, 12, 0)))

	half, err := Parse("*/30 * * * *", loc, true)
	require.NoError(t, err)
	// Local 01:30, then 02:00 (skipped: at 03:00 CEST), 03:30, 04:00.
	require.Equal(t, []time.Time{utc(3, 31, 0, 30), utc(3, 31, 1, 0), utc(3, 31, 1, 30), utc(3, 31, 2, 0)},
		ticksBetween(half, utc(3, 31, 0, 0), utc(3, 31, 2, 0)))
	// Local 02:00 and 02:30 summer time; the repeated hour does not tick again.
	require.Equal(t, []time.Time{utc(10, 27, 0, 0), utc(10, 27, 0, 30), utc(10, 27, 2, 0)},
		ticksBetween(half, utc(10, 26, 23, 30), utc(10, 27, 2, 0)))
}

// Instances start at different times; each must compute the same ticks from
// wherever it starts, or one alone would skip some.
func TestTicksDoNotDependOnWhereCountingStarts(t *testing.T) {
	loc := berlin(t)
	for _, spec := range []string{"*/15 * * * *", "30 2 * * *", "0,30 2,3 * * *", "20 * * * * *"} {
		sch, err := Parse(spec, loc, true)
		require.NoError(t, err)
		for _, day := range []time.Time{utc(3, 30, 20, 0), utc(10, 26, 20, 0)} {
			end := day.Add(10 * time.Hour)
			all := ticksBetween(sch, day, end)
			for start := day; start.Before(end); start = start.Add(7*time.Minute + 13*time.Second) {
				var want []time.Time
				for _, tick := range all {
					if tick.After(start) {
						want = append(want, tick)
					}
				}
				require.Equal(t, want, ticksBetween(sch, start, end), "%s from %s", spec, start)
			}
		}
	}
}

// A step longer than its field is a spec that reads as one thing and
// fires as another: */90 in the minutes fires hourly, at :00, not every
// 90 minutes. It is refused, with the spec that says what was meant.
func TestStepsLongerThanTheirFieldAreRefused(t *testing.T) {
	for spec, field := range map[string]string{
		"*/61 * * * *":         "minute",
		"*/90 * * * *":         "minute",
		"0 */25 * * *":         "hour",
		"0 0 */32 * *":         "day of month",
		"0 0 1 */13 *":         "month",
		"0 0 * * 1-5/8":        "day of week",
		"*/61 * * * * *":       "second",
		"0 5,10-59/61 * * * *": "minute",
	} {
		_, err := Parse(spec, time.UTC, false)
		if err == nil {
			t.Errorf("%q: accepted", spec)
			continue
		}
		if !strings.Contains(err.Error(), field) || !strings.Contains(err.Error(), "@every") {
			t.Errorf("%q: %v, want it to name the %s field and suggest @every", spec, err, field)
		}
	}
	for _, spec := range []string{"*/60 * * * *", "*/15 * * * *", "0 */12 * * *", "0 0 1-31/31 * *", "0 0 * * */7", "@hourly", "@every 90m"} {
		if _, err := Parse(spec, time.UTC, false); err != nil {
			t.Errorf("%q: %v", spec, err)
		}
	}
}
