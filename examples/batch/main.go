// Command batch is the example of the batches guide (docs/batches.md): a billing run sends its
// invoices as one batch, and its summary is sent once, when every invoice
// job has ended.
package main

import (
	"context"
	"fmt"
	"log"
	"os"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/keeljobs/keel/migrate"
	"github.com/keeljobs/keel/server"
	"github.com/keeljobs/keel/tasks"
)

type Invoice struct {
	ID string `json:"id"`
}

var SendInvoice = tasks.Define[Invoice]("billing:send_invoice",
	tasks.Key(func(i Invoice) string { return "invoice:" + i.ID }))

// RunDone is the batch's callback kind: its handler gets a tasks.BatchDone.
var RunDone = tasks.DefineBatchDone("billing:run_done")

func main() {
	ctx, stop := context.WithCancel(context.Background())
	defer stop()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	check(err)
	defer pool.Close()
	_, err = migrate.Up(ctx, pool)
	check(err)
	redis := asynq.RedisClientOpt{Addr: os.Getenv("REDIS_ADDR")}
	client, err := tasks.NewClient(tasks.ClientConfig{Redis: redis, Pool: pool})
	check(err)
	defer client.Close()

	summaries := make(chan tasks.BatchDone, 1)
	mux := tasks.NewMux()
	tasks.Handle(mux, SendInvoice, func(ctx context.Context, i Invoice) error {
		return nil // render and send the invoice
	})
	tasks.Handle(mux, RunDone, func(ctx context.Context, d tasks.BatchDone) error {
		summaries <- d // mail the finance team: d.Counts, d.Data
		return nil
	})
	srv, err := server.New(server.Config{Redis: redis, Pool: pool}, mux)
	check(err)
	stopped := make(chan error, 1)
	go func() { stopped <- srv.Run(ctx) }()

	// The batch, its invoices and the seal commit together, or none of them.
	run := time.Now().UTC().Format("2006-01-02T15:04:05.000")
	tx, err := pool.Begin(ctx)
	check(err)
	batch, err := client.NewBatchTx(ctx, tx, tasks.BatchSpec{Description: "billing run " + run,
		OnComplete: tasks.BatchCallback(RunDone, map[string]string{"run": run})})
	check(err)
	invoices := make([]*tasks.Task, 3)
	for i := range invoices {
		invoices[i] = SendInvoice.New(Invoice{ID: fmt.Sprintf("%s-%d", run, i+1)}, tasks.InBatch(batch.ID))
	}
	_, err = client.EnqueueManyTx(ctx, tx, invoices...)
	check(err)
	_, err = client.SealBatchTx(ctx, tx, batch.ID)
	check(err)
	check(tx.Commit(ctx))

	d := <-summaries
	stop() // a graceful stop: the callback's success is recorded first
	check(<-stopped)
	fmt.Printf("%d invoices: %d sent, %d dead (completion %d)\n", d.Counts.Total, d.Counts.Succeeded, d.Counts.Dead, d.Generation)
}

func check(err error) {
	if err != nil {
		log.Fatal(err)
	}
}
