package tasks_test

import (
	"context"
	"fmt"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/keeljobs/keel/internal/testenv"
	"github.com/keeljobs/keel/migrate"
	"github.com/keeljobs/keel/tasks"
)

type Receipt struct {
	OrderID string `json:"order_id"`
	Email   string `json:"email"`
}

// SendReceipt is declared once, at package level: its name, payload type,
// business key and default queue.
var SendReceipt = tasks.Define[Receipt]("example:send_receipt",
	tasks.Queue("critical"),
	tasks.MaxRetry(5),
	tasks.Key(func(r Receipt) string { return "order:" + r.OrderID }),
	tasks.Summary(func(r Receipt) string { return "receipt for order " + r.OrderID }), // no e-mail address in dead letters
)

func Example() {
	t := SendReceipt.New(Receipt{OrderID: "1001", Email: "ada@example.com"})
	fmt.Println(t.Kind(), t.BusinessKey(), t.Queue())
	fmt.Println(string(t.Payload()))

	// Options given to New override the kind's defaults for this task only.
	t = SendReceipt.New(Receipt{OrderID: "1001"}, tasks.Queue("low"), tasks.BusinessKey("order:1001:resend"))
	fmt.Println(t.BusinessKey(), t.Queue())
	// Output:
	// example:send_receipt order:1001 critical
	// {"order_id":"1001","email":"ada@example.com"}
	// order:1001:resend low
}

func ExampleClient_Enqueue() {
	ctx := context.Background()
	pool, redis := examplePoolAndRedis(ctx)
	defer pool.Close()

	client, err := tasks.NewClient(tasks.ClientConfig{Redis: redis, Pool: pool})
	if err != nil {
		panic(err)
	}
	defer client.Close()

	first, err := client.Enqueue(ctx, SendReceipt.New(Receipt{OrderID: "1002"}))
	if err != nil {
		panic(err)
	}
	fmt.Println("existed:", first.Existed, "published:", first.Published, "status:", first.Job.Status)

	// The same business action again (a retried HTTP request, say) returns
	// the job that exists; nothing runs twice.
	again, err := client.Enqueue(ctx, SendReceipt.New(Receipt{OrderID: "1002"}))
	if err != nil {
		panic(err)
	}
	fmt.Println("existed:", again.Existed, "same job:", again.Job.ID == first.Job.ID)

	// Redis holds the task under the ledger id.
	insp := asynq.NewInspector(redis)
	defer insp.Close()
	info, err := insp.GetTaskInfo("critical", first.Job.ID)
	if err != nil {
		panic(err)
	}
	fmt.Println(info.Type, info.Headers[tasks.HeaderBusinessKey], info.State)
	// Output:
	// existed: false published: true status: pending
	// existed: true same job: true
	// example:send_receipt order:1002 pending
}

// examplePoolAndRedis connects to the test services with the ledger in a
// fresh schema, as a program would connect to its own.
func examplePoolAndRedis(ctx context.Context) (*pgxpool.Pool, asynq.RedisClientOpt) {
	setupMu.Lock()
	defer setupMu.Unlock()
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	cfg, err := testenv.PoolConfig(ctx, schema)
	if err != nil {
		panic(err)
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		panic(err)
	}
	if _, err := migrate.Up(ctx, pool); err != nil {
		panic(err)
	}
	return pool, asynq.RedisClientOpt{Addr: testenv.RedisAddr(), DB: testenv.DBTasks}
}
