package migrate

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// Old binaries in tests: the migrations a binary knows are a parameter.
var (
	CheckWith = checkSchema
	UpWith    = migrate
)

func TestMigrationFilesDeclareTheirMarkers(t *testing.T) {
	ms, err := All()
	require.NoError(t, err)
	flags := map[int][2]bool{}
	for _, m := range ms {
		flags[m.Version] = [2]bool{m.NoTransaction, m.Additive}
	}
	// {no-transaction, additive}
	require.Equal(t, [2]bool{false, false}, flags[1])
	require.Equal(t, [2]bool{true, true}, flags[4], "0004 builds its indexes concurrently")
	require.Equal(t, [2]bool{false, true}, flags[5])
	require.Equal(t, [2]bool{true, true}, flags[6])
	require.Equal(t, [2]bool{false, true}, flags[7])
	require.Equal(t, [2]bool{true, true}, flags[8], "0008 swaps the status check and builds an index concurrently")
}

func TestMigrationMarkersAreChecked(t *testing.T) {
	for name, sql := range map[string]string{
		"plain index outside a transaction": "-- keel:no-transaction\nCREATE INDEX i ON t (a);",
		"concurrent index without a name":   "-- keel:no-transaction\nCREATE INDEX CONCURRENTLY ON t (a);",
		"not idempotent":                    "-- keel:no-transaction\nCREATE INDEX CONCURRENTLY i ON t (a);",
		"concurrently inside a transaction": "CREATE INDEX CONCURRENTLY IF NOT EXISTS i ON t (a);",
		"misspelt marker":                   "-- keel:additve\nALTER TABLE t ADD COLUMN b int;",
	} {
		_, err := parseMigration(9, "0009_x", sql)
		require.Error(t, err, name)
	}
	m, err := parseMigration(9, "0009_x", "-- keel:additive\n\n-- why\n-- keel:no-transaction\nCREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS \"i x\" ON t (a);")
	require.NoError(t, err)
	require.True(t, m.Additive)
	require.True(t, m.NoTransaction)
	m, err = parseMigration(9, "0009_x", "ALTER TABLE t ADD COLUMN b int;\n-- keel:additive\n")
	require.NoError(t, err)
	require.False(t, m.Additive, "a marker after the first statement does not count")
}

func TestSplitStatementsKeepsQuotedSemicolons(t *testing.T) {
	stmts, err := splitStatements("-- a; comment\nSELECT ';', \"a;b\" /* ; */ FROM t;\n\nDO $x$ BEGIN PERFORM 1; END $x$;  SELECT 'it''s;'\n")
	require.NoError(t, err)
	require.Equal(t, []string{
		`SELECT ';', "a;b"   FROM t`,
		`DO $x$ BEGIN PERFORM 1; END $x$`,
		`SELECT 'it''s;'`,
	}, stmts)
	_, err = splitStatements("SELECT 'open")
	require.Error(t, err)
}
