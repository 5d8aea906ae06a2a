package scheduler

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/keeljobs/keel/internal/ledger"
)

// store reads and writes keel_schedule, the newest tick handled per entry.
type store struct{ pool *pgxpool.Pool }

// load returns the newest tick handled of each named entry that has a row,
// and gives the others one: handled up to since, the time each was taken on.
func (s store) load(ctx context.Context, names []string, since []time.Time, specs, zones []string) (map[string]ledger.ScheduleMark, error) {
	out, err := ledger.LoadSchedule(ctx, s.pool, names, since, specs, zones)
	return out, interpretError(err)
}

// markTick records that entry's ticks up to tick are handled.
func (s store) markTick(ctx context.Context, entry string, tick time.Time) error {
	return interpretError(ledger.MarkTick(ctx, s.pool, entry, tick))
}

// interpretError is the one place pgx errors become the scheduler's.
func interpretError(err error) error {
	if err == nil {
		return nil
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && (pgErr.Code == "42P01" || pgErr.Code == "42703") {
		return fmt.Errorf("keel scheduler: a table or column of the schedule is missing: run `keel migrate`: %w", err)
	}
	return fmt.Errorf("keel scheduler: %w", err)
}

// runtime reads the run-time entries and the paused entries.
func (s store) runtime(ctx context.Context) ([]ledger.ScheduleEntry, []ledger.SchedulePause, error) {
	rows, err := ledger.ScheduleEntries(ctx, s.pool)
	if err != nil {
		return nil, nil, interpretError(err)
	}
	pauses, err := ledger.SchedulePauses(ctx, s.pool)
	return rows, pauses, interpretError(err)
}

// describe records what the entries are in their keel_schedule rows, for
// the operator's view of file and code entries.
func (s store) describe(ctx context.Context, entries []compiled, now time.Time) error {
	n := len(entries)
	names, specs, zones, kinds := make([]string, 0, n), make([]string, 0, n), make([]string, 0, n), make([]string, 0, n)
	for _, c := range entries {
		names, specs, zones, kinds = append(names, c.Name), append(specs, c.Spec), append(zones, c.TimeZone), append(kinds, c.Kind)
	}
	_, err := ledger.DescribeSchedule(ctx, s.pool, names, specs, zones, kinds, now)
	return interpretError(err)
}
