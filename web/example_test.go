package web_test

import (
	"context"
	"log"
	"os"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/keeljobs/keel/tasks"
	"github.com/keeljobs/keel/web"
)

// The dashboard on loopback (the default address): keel's pages beside
// asynqmon, with the program's kinds so that payloads are shown through
// their Summary.
func ExampleNew() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	type Receipt struct{ OrderID string }
	kinds := tasks.NewKinds(tasks.Define[Receipt]("order:send_receipt"))
	srv, err := web.New(web.Config{Redis: asynq.RedisClientOpt{Addr: "127.0.0.1:6379"}, Pool: pool, Kinds: kinds})
	if err != nil {
		log.Fatal(err)
	}
	if err := srv.Run(ctx); err != nil {
		log.Fatal(err)
	}
}
