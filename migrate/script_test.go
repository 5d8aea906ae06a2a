package migrate_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/migrate"
)

// Script is what a DBA runs by hand: each migration as it is run, then the
// row Up records for it.
func TestScriptRecordsEachMigrationAsUpDoes(t *testing.T) {
	got := migrate.Script([]migrate.Migration{
		{Version: 7, Name: "0007_a", SQL: "\nCREATE TABLE a (x int);\n", Additive: true},
		{Version: 8, Name: "0008_b", SQL: "CREATE INDEX CONCURRENTLY IF NOT EXISTS b ON a (x);", NoTransaction: true},
	})
	require.Equal(t, `-- 0007_a: run in one transaction, recorded in it
CREATE TABLE a (x int);
INSERT INTO keel_schema_migrations (version, name, additive) VALUES (7, '0007_a', true);

-- 0008_b: run statement by statement, outside a transaction (CREATE INDEX CONCURRENTLY)
CREATE INDEX CONCURRENTLY IF NOT EXISTS b ON a (x);
INSERT INTO keel_schema_migrations (version, name, additive) VALUES (8, '0008_b', false);

`, got)
	require.Empty(t, migrate.Script(nil))
}
