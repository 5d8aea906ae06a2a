package server_test

import (
	"context"
	"log"
	"os"
	"os/signal"
	"syscall"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/keeljobs/keel/server"
	"github.com/keeljobs/keel/tasks"
)

// A worker: the kinds it handles on a mux, a pool sized for its
// concurrency, and Run until SIGTERM, when running jobs finish (or are
// released without using an attempt) and the rest stay queued.
func ExampleNew() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	cfg, err := pgxpool.ParseConfig(os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	cfg.MaxConns = int32(server.PoolSize(server.DefaultConcurrency))
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()

	type Receipt struct{ OrderID string }
	sendReceipt := tasks.Define[Receipt]("order:send_receipt",
		tasks.Key(func(r Receipt) string { return "order:" + r.OrderID }))
	mux := tasks.NewMux()
	tasks.Handle(mux, sendReceipt, func(ctx context.Context, r Receipt) error {
		return nil // the work; see idempotency.Step and idempotency.InTx
	})

	srv, err := server.New(server.Config{Redis: asynq.RedisClientOpt{Addr: "127.0.0.1:6379"}, Pool: pool}, mux)
	if err != nil {
		log.Fatal(err)
	}
	if err := srv.Run(ctx); err != nil {
		log.Fatal(err)
	}
}
