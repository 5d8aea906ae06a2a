package ledger

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
)

// loadScheduleSQL returns the rows that exist and creates the missing
// ones, so that downtime before an entry's first tick is known as such at
// the next start. The SELECT runs on the statement's snapshot: it sees
// only the old rows.
const loadScheduleSQL = `WITH created AS (
	INSERT INTO keel_schedule (entry, last_tick, spec, timezone)
	SELECT * FROM unnest($1::text[], $2::timestamptz[], $3::text[], $4::text[])
	ON CONFLICT (entry) DO NOTHING)
SELECT entry, last_tick, coalesce(spec, ''), timezone FROM keel_schedule WHERE entry = ANY($1)`

// ScheduleMark is an entry's newest tick handled, and the schedule it was
// handled under as the schedulers running it last said (Spec empty: none
// said, an older scheduler).
type ScheduleMark struct {
	Tick           time.Time
	Spec, TimeZone string
}

// LoadSchedule returns the newest tick handled of each named entry of the
// scheduler that has a row in keel_schedule, and gives the others one:
// handled up to since[i], the time entry names[i] was taken on, under the
// schedule specs[i] in zones[i].
func LoadSchedule(ctx context.Context, db DB, names []string, since []time.Time, specs, zones []string) (map[string]ScheduleMark, error) {
	rows, err := db.Query(ctx, loadScheduleSQL, names, since, specs, zones)
	if err != nil {
		return nil, err
	}
	out := map[string]ScheduleMark{}
	var name string
	var m ScheduleMark
	_, err = pgx.ForEachRow(rows, []any{&name, &m.Tick, &m.Spec, &m.TimeZone}, func() error {
		out[name] = m
		return nil
	})
	return out, err
}

// markTickSQL: the WHERE keeps last_tick from moving back when instances
// race, and spares a row version when another instance already recorded
// the tick.
const markTickSQL = `INSERT INTO keel_schedule AS s (entry, last_tick) VALUES ($1, $2)
	ON CONFLICT (entry) DO UPDATE SET last_tick = excluded.last_tick, updated_at = now()
	WHERE s.last_tick < excluded.last_tick`

// MarkTick records that the scheduler's entry has its ticks up to tick
// handled.
func MarkTick(ctx context.Context, db DB, entry string, tick time.Time) error {
	_, err := db.Exec(ctx, markTickSQL, entry, tick)
	return err
}
