package migrate_test

import (
	"context"
	"fmt"
	"log"
	"os"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/keeljobs/keel/migrate"
)

// Creating or upgrading the ledger before workers and clients start. Any
// number of processes may run it at once.
func ExampleUp() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	if _, err := migrate.Up(ctx, pool); err != nil {
		log.Fatal(err)
	}
}

// What a DBA reads before an upgrade: the SQL of the migrations the
// database lacks (keel migrate --print), changing nothing.
func ExampleScript() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	pending, err := migrate.Pending(ctx, pool)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Print(migrate.Script(pending))
}
