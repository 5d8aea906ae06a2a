package idempotency

import (
	"context"
	"embed"
	"fmt"
	"io/fs"
	"path"
	"sort"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

//go:embed migrations/*.sql
var migrationFS embed.FS

// Migration is one numbered schema change shipped inside the binary.
type Migration struct {
	Version int
	Name    string
	SQL     string
}

// Migrations returns the embedded migrations in order.
func Migrations() ([]Migration, error) {
	entries, err := fs.ReadDir(migrationFS, "migrations")
	if err != nil {
		return nil, err
	}
	var ms []Migration
	for _, e := range entries {
		name := e.Name()
		num, _, ok := strings.Cut(name, "_")
		v, err := strconv.Atoi(num)
		if !ok || err != nil {
			return nil, fmt.Errorf("keel: migration file %q is not named NNNN_name.sql", name)
		}
		body, err := migrationFS.ReadFile(path.Join("migrations", name))
		if err != nil {
			return nil, err
		}
		ms = append(ms, Migration{Version: v, Name: strings.TrimSuffix(name, ".sql"), SQL: string(body)})
	}
	sort.Slice(ms, func(i, j int) bool { return ms[i].Version < ms[j].Version })
	return ms, nil
}

// SchemaVersion is the newest ledger schema this build knows.
func SchemaVersion() int {
	ms, err := Migrations()
	if err != nil || len(ms) == 0 {
		return 0
	}
	return ms[len(ms)-1].Version
}

// ErrSchemaTooNew means the database was migrated by a newer keel.
var ErrSchemaTooNew = fmt.Errorf("keel: ledger schema is newer than this binary")

// MigrateResult says what Migrate did.
type MigrateResult struct {
	From, To int
	Applied  []string
}

// Migrate brings the ledger schema up to date. It is safe to run from many
// processes at once (an advisory lock serialises them) and a no-op when the
// schema is current. A schema newer than this binary is refused with
// ErrSchemaTooNew, because an old binary could corrupt rows it does not
// understand.
func Migrate(ctx context.Context, pool *pgxpool.Pool) (MigrateResult, error) {
	ms, err := Migrations()
	if err != nil {
		return MigrateResult{}, err
	}
	var res MigrateResult
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		// Any constant works as long as every keel uses the same one.
		if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock(7365434901)`); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS keel_schema_migrations (
			version    integer PRIMARY KEY,
			name       text NOT NULL,
			applied_at timestamptz NOT NULL DEFAULT now())`); err != nil {
			return err
		}
		rows, err := tx.Query(ctx, `SELECT version FROM keel_schema_migrations`)
		if err != nil {
			return err
		}
		versions, err := pgx.CollectRows(rows, pgx.RowTo[int32])
		if err != nil {
			return err
		}
		applied := map[int]bool{}
		current := 0
		for _, v := range versions {
			applied[int(v)] = true
			current = max(current, int(v))
		}
		res.From, res.To = current, current
		known := ms[len(ms)-1].Version
		if current > known {
			return fmt.Errorf("%w: database is at version %d, this keel knows up to %d; upgrade keel", ErrSchemaTooNew, current, known)
		}
		// Applied by set, not by high-water mark: a migration merged after a
		// higher-numbered one still runs.
		for _, m := range ms {
			if applied[m.Version] {
				continue
			}
			if _, err := tx.Exec(ctx, m.SQL); err != nil {
				return fmt.Errorf("keel: migration %s: %w", m.Name, err)
			}
			if _, err := tx.Exec(ctx, `INSERT INTO keel_schema_migrations (version, name) VALUES ($1, $2)`, m.Version, m.Name); err != nil {
				return err
			}
			res.Applied = append(res.Applied, m.Name)
			res.To = max(res.To, m.Version)
		}
		return nil
	})
	return res, err
}

// CheckSchema returns an error unless the ledger is exactly at the version this
// binary knows: workers refuse to start on a stale or newer schema.
func CheckSchema(ctx context.Context, pool *pgxpool.Pool) error {
	var current, count int
	err := pool.QueryRow(ctx, `SELECT coalesce(max(version), 0), count(*) FROM keel_schema_migrations`).Scan(&current, &count)
	if err != nil {
		if isUndefinedTable(err) {
			return fmt.Errorf("keel: the ledger has no schema yet: run `keel migrate`")
		}
		return interpretError(err)
	}
	known := SchemaVersion()
	switch {
	case current > known:
		return fmt.Errorf("%w: database is at version %d, this keel knows up to %d; upgrade keel", ErrSchemaTooNew, current, known)
	case current < known || count < len(mustMigrations()):
		return fmt.Errorf("keel: ledger schema is at version %d, this keel needs %d: run `keel migrate`", current, known)
	}
	return nil
}

func mustMigrations() []Migration {
	ms, _ := Migrations()
	return ms
}
