package inspect_test

import (
	"context"
	"fmt"
	"log"
	"os"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/keeljobs/keel/inspect"
)

// How many jobs of a kind stand in each status, from the ledger: what a
// program asks instead of writing SQL on keel's tables.
func ExampleInspector_Counts() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	in, err := inspect.New(inspect.Config{Pool: pool})
	if err != nil {
		log.Fatal(err)
	}
	defer in.Close()
	counts, err := in.Counts(ctx, "order:send_receipt")
	if err != nil {
		log.Fatal(err)
	}
	for _, c := range counts {
		fmt.Printf("%s %s: %d\n", c.Kind, c.Status, c.N)
	}
}

// Replaying a dead job, as a person would from the CLI or the dashboard:
// audited under the actor's name, refused while a step is in doubt or
// after its completing InTx committed.
func ExampleInspector_Replay() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	in, err := inspect.New(inspect.Config{Pool: pool, Redis: asynq.RedisClientOpt{Addr: "127.0.0.1:6379"}})
	if err != nil {
		log.Fatal(err)
	}
	defer in.Close()
	if _, err := in.Replay(ctx, os.Args[1], "alice", "the mail provider is back"); err != nil {
		log.Fatal(err)
	}
	job, err := in.WaitDone(ctx, os.Args[1])
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(job.Status)
}
