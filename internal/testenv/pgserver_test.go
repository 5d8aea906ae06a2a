package testenv_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/keeljobs/keel/internal/testenv"
)

// TestPostgresServer checks that a private Postgres starts, keeps its data
// across a restart, and refuses connections while stopped.
func TestPostgresServer(t *testing.T) {
	pg := testenv.StartPostgres(t)
	ctx := context.Background()
	exec := func(sql string) error {
		conn, err := pgx.Connect(ctx, pg.URL(""))
		if err != nil {
			return err
		}
		defer conn.Close(ctx)
		_, err = conn.Exec(ctx, sql)
		return err
	}
	if err := exec(`CREATE TABLE kept (n int); INSERT INTO kept VALUES (1)`); err != nil {
		t.Fatal(err)
	}
	pg.Stop()
	if err := exec(`SELECT 1`); err == nil {
		t.Fatal("a stopped server answered")
	}
	pg.Start()
	if err := exec(`DO $$ BEGIN IF (SELECT count(*) FROM kept) <> 1 THEN RAISE 'lost'; END IF; END $$`); err != nil {
		t.Fatalf("data after restart: %v", err)
	}
}
