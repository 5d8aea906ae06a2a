package alert_test

import (
	"context"
	"log"
	"os"
	"os/signal"
	"syscall"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/keeljobs/keel/alert"
	"github.com/keeljobs/keel/server"
	"github.com/keeljobs/keel/tasks"
)

// An Alerter is wired into a worker as the ledger guard's OnDead hook, and
// runs beside it until the worker stops.
func Example() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()

	alerter, err := alert.New(alert.Config{WebhookURL: os.Getenv("KEEL_ALERT_WEBHOOK")})
	if err != nil {
		log.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- alerter.Run(ctx) }() // sends what is left when ctx ends

	cfg := server.Config{Redis: asynq.RedisClientOpt{Addr: "127.0.0.1:6379"}, Pool: pool}
	cfg.Guard.OnDead = alerter.JobDied
	srv, err := server.New(cfg, tasks.NewMux())
	if err != nil {
		log.Fatal(err)
	}
	if err := srv.Run(ctx); err != nil {
		log.Print(err)
	}
	<-done
}
