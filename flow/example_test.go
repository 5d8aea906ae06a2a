package flow_test

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/hibiken/asynq"

	"github.com/keeljobs/keel/flow"
	"github.com/keeljobs/keel/internal/testenv"
	"github.com/keeljobs/keel/retry"
)

// A handler calls Take right before the call a rate protects. When no start
// is due within the hold (here cut short by the job's deadline), Take returns
// a wait for the handler to return: the job comes back later, its attempts
// untouched.
func ExampleController_Take() {
	redisOpt := asynq.RedisClientOpt{Addr: testenv.RedisAddr(), DB: testenv.DBFlow}
	limits, err := flow.New(flow.Config{
		Redis: redisOpt,
		Rules: []flow.Rule{{Name: "example-mail", Rate: 1, Period: time.Second}},
		Hold:  2 * time.Second,
	})
	if err != nil {
		panic(err)
	}
	defer limits.Close()

	err = limits.Take(context.Background(), "example-mail")
	fmt.Println("first call may go:", err == nil)

	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	err = limits.Take(ctx, "example-mail")
	fmt.Println("second call postponed:", retry.IsWait(err), errors.Is(err, flow.ErrRateLimited))
	// Output:
	// first call may go: true
	// second call postponed: true true
}
