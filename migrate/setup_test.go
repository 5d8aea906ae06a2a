package migrate_test

import (
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/keeljobs/keel/internal/testenv"
)

const schema = "keel_test_migrate"

type bundle struct{ pool *pgxpool.Pool }

// setup gives a test the package's schema, migrated afresh.
func setup(t *testing.T) *bundle {
	t.Helper()
	return &bundle{pool: testenv.Pool(t, schema)}
}
