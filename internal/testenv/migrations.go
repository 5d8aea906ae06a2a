package testenv

import (
	"context"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/keeljobs/keel/migrate"
)

// ReapplyMigration runs the migration named name again, as an upgrade from
// a version before it would, over the rows the test wrote meanwhile.
func ReapplyMigration(t testing.TB, pool *pgxpool.Pool, name string) {
	t.Helper()
	ms, err := migrate.All()
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range ms {
		if strings.HasSuffix(m.Name, "_"+name) {
			_, err := pool.Exec(context.Background(), `DELETE FROM keel_schema_migrations WHERE version = $1`, m.Version)
			if err != nil {
				t.Fatal(err)
			}
			_, err = migrate.Up(context.Background(), pool)
			if err != nil {
				t.Fatal(err)
			}
			return
		}
	}
	t.Fatalf("no migration named %q", name)
}
