package idempotency_test

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/keeljobs/keel/idempotency"
)

// A handler's local writes commit with the job's completion; its external
// call is a recorded step with a stable idempotency key.
func ExampleStep() {
	handle := func(ctx context.Context, orderID string) error {
		err := idempotency.Step(ctx, "charge", func(ctx context.Context, key string) error {
			// Pass key to the payment API as its idempotency key.
			return nil
		})
		if err != nil {
			return err
		}
		return idempotency.InTx(ctx, func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `UPDATE orders SET paid = true WHERE id = $1`, orderID)
			return err
		})
	}
	// Outside a handler run by keel's worker there is no job to record in.
	err := handle(context.Background(), "123")
	fmt.Println(errors.Is(err, idempotency.ErrNoJob))
	fmt.Println(idempotency.StepKey("0193c1d2", "charge"))
	// Output:
	// true
	// 0193c1d2:charge
}
