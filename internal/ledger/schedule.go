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
	INSERT INTO keel_schedule (entry, last_tick)
	SELECT * FROM unnest($1::text[], $2::timestamptz[])
	ON CONFLICT (entry) DO NOTHING)
SELECT entry, last_tick FROM keel_schedule WHERE entry = ANY($1)`

// LoadSchedule returns the newest tick handled of each named entry of the
// scheduler that has a row in keel_schedule, and gives the others one:
// handled up to since[i], the time entry names[i] was taken on.
func LoadSchedule(ctx context.Context, db DB, names []string, since []time.Time) (map[string]time.Time, error) {
	rows, err := db.Query(ctx, loadScheduleSQL, names, since)
	if err != nil {
		return nil, err
	}
	out := map[string]time.Time{}
	var name string
	var tick time.Time
	_, err = pgx.ForEachRow(rows, []any{&name, &tick}, func() error {
		out[name] = tick
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
