// Command workflow is the example of the workflows guide (docs/workflows.md):
// an order's fulfilment as four jobs, charge first, packing and invoicing
// after it, shipping once both are done, enqueued in one call.
package main

import (
	"context"
	"fmt"
	"log"
	"os"
	"sync"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/keeljobs/keel/migrate"
	"github.com/keeljobs/keel/server"
	"github.com/keeljobs/keel/tasks"
)

type Order struct {
	ID string `json:"id"`
}

// One kind per step; each dedupes by its order, as any keel job does.
var (
	Charge  = tasks.Define[Order]("orders:charge", tasks.Key(func(o Order) string { return "charge:" + o.ID }))
	Pack    = tasks.Define[Order]("orders:pack", tasks.Key(func(o Order) string { return "pack:" + o.ID }))
	Invoice = tasks.Define[Order]("orders:invoice", tasks.Key(func(o Order) string { return "invoice:" + o.ID }))
	Ship    = tasks.Define[Order]("orders:ship", tasks.Key(func(o Order) string { return "ship:" + o.ID }))
)

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

	var mu sync.Mutex
	var ran []string
	step := func(name string) func(context.Context, Order) error {
		return func(ctx context.Context, o Order) error {
			mu.Lock()
			defer mu.Unlock()
			ran = append(ran, name) // charge the card, pack the box, ...
			return nil
		}
	}
	shipped := make(chan struct{})
	mux := tasks.NewMux()
	tasks.Handle(mux, Charge, step("charge"))
	tasks.Handle(mux, Pack, step("pack"))
	tasks.Handle(mux, Invoice, step("invoice"))
	tasks.Handle(mux, Ship, func(ctx context.Context, o Order) error {
		defer close(shipped)
		return step("ship")(ctx, o)
	})
	srv, err := server.New(server.Config{Redis: redis, Pool: pool}, mux)
	check(err)
	stopped := make(chan error, 1)
	go func() { stopped <- srv.Run(ctx) }()

	order := Order{ID: time.Now().UTC().Format("20060102T150405.000")}
	wf := tasks.NewWorkflow("fulfil-"+order.ID).
		Add("charge", Charge.New(order)).
		Add("pack", Pack.New(order), "charge").
		Add("invoice", Invoice.New(order), "charge").
		Add("ship", Ship.New(order), "pack", "invoice")
	_, err = client.EnqueueWorkflow(ctx, wf)
	check(err)

	<-shipped
	stop() // a graceful stop: the last success is recorded first
	check(<-stopped)
	nodes, err := client.Inspector().Workflow(context.Background(), "fulfil-"+order.ID)
	check(err)
	for _, n := range nodes {
		fmt.Printf("%s: %s\n", n.Task, n.Status)
	}
	first, last := ran[0], ran[len(ran)-1]
	fmt.Printf("charge first: %v; ship last: %v; %d runs\n", first == "charge", last == "ship", len(ran))
}

func check(err error) {
	if err != nil {
		log.Fatal(err)
	}
}
