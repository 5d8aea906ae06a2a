package scheduler

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// store reads and writes keel_schedule, the newest tick handled per entry.
type store struct{ pool *pgxpool.Pool }

// loadSQL returns the rows that exist and creates the missing ones, so that
// downtime before an entry's first tick is known as such at the next start.
// The SELECT runs on the statement's snapshot: it sees only the old rows.
const loadSQL = `WITH created AS (
	INSERT INTO keel_schedule (entry, last_tick)
	SELECT * FROM unnest($1::text[], $2::timestamptz[])
	ON CONFLICT (entry) DO NOTHING)
SELECT entry, last_tick FROM keel_schedule WHERE entry = ANY($1)`

// The WHERE keeps last_tick from moving back when instances race, and spares
// a row version when another instance already recorded the tick.
const markTickSQL = `INSERT INTO keel_schedule AS s (entry, last_tick) VALUES ($1, $2)
	ON CONFLICT (entry) DO UPDATE SET last_tick = excluded.last_tick, updated_at = now()
	WHERE s.last_tick < excluded.last_tick`

// load returns the newest tick handled of each named entry that has a row,
// and gives the others one: handled up to since, the time each was taken on.
func (s store) load(ctx context.Context, names []string, since []time.Time) (map[string]time.Time, error) {
	rows, err := s.pool.Query(ctx, loadSQL, names, since)
	if err != nil {
		return nil, interpretError(err)
	}
	out := map[string]time.Time{}
	var name string
	var tick time.Time
	_, err = pgx.ForEachRow(rows, []any{&name, &tick}, func() error {
		out[name] = tick
		return nil
	})
	return out, interpretError(err)
}

// markTick records that entry's ticks up to tick are handled.
func (s store) markTick(ctx context.Context, entry string, tick time.Time) error {
	_, err := s.pool.Exec(ctx, markTickSQL, entry, tick)
	return interpretError(err)
}

// interpretError is the one place pgx errors become the scheduler's.
func interpretError(err error) error {
	if err == nil {
		return nil
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "42P01" {
		return fmt.Errorf("keel scheduler: table keel_schedule is missing: run `keel migrate`: %w", err)
	}
	return fmt.Errorf("keel scheduler: %w", err)
}
