package outbox_test

import (
	"context"
	"log"
	"os"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/keeljobs/keel/outbox"
)

// A relay of its own (a worker embeds one by default): it publishes the
// jobs EnqueueTx committed, woken by their transactions, and polls while
// writers keep it busy. Any number may run.
func ExampleNewRelay() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	relay, err := outbox.NewRelay(outbox.RelayConfig{Pool: pool, Redis: asynq.RedisClientOpt{Addr: "127.0.0.1:6379"}})
	if err != nil {
		log.Fatal(err)
	}
	defer relay.Close()
	if err := relay.Run(ctx); err != nil {
		log.Fatal(err)
	}
}
