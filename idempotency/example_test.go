package idempotency_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/retry"
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

// One HTTP call as a step: sent once with the step's key in its
// Idempotency-Key header; a call that may have happened is settled by
// Verify on the next attempt, never sent again blindly. Steps come first,
// the completing InTx last.
func ExampleStepHTTP() {
	client := &http.Client{Timeout: 10 * time.Second}
	handle := func(ctx context.Context, orderID, email string) error {
		err := idempotency.StepHTTP(ctx, "mail", client,
			func(ctx context.Context, key string) (*http.Request, error) {
				body := strings.NewReader(`{"to":"` + email + `"}`)
				return http.NewRequestWithContext(ctx, http.MethodPost, "https://mail.example/send", body)
			},
			idempotency.Verify(func(ctx context.Context, key string) (bool, error) {
				req, err := http.NewRequestWithContext(ctx, http.MethodGet, "https://mail.example/sent?key="+url.QueryEscape(key), nil)
				if err != nil {
					return false, err
				}
				resp, err := client.Do(req)
				if err != nil {
					return false, err
				}
				resp.Body.Close()
				if resp.StatusCode != http.StatusOK && resp.StatusCode != http.StatusNotFound {
					return false, retry.FromResponse(resp)
				}
				return resp.StatusCode == http.StatusOK, nil
			}))
		if err != nil {
			return err
		}
		return idempotency.InTx(ctx, func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `UPDATE orders SET receipt_sent_at = now() WHERE id = $1`, orderID)
			return err
		})
	}
	_ = handle
}

// A long handler reports how far it has got, as often as it likes (keel
// writes at most one report a second), and stores a result that commits
// with the job's success.
func ExampleSetResult() {
	type export struct {
		File string `json:"file"`
		Rows int    `json:"rows"`
	}
	handle := func(ctx context.Context, pages []string) error {
		rows := 0
		for i := range pages {
			rows += 100 // write the page
			// Its errors say the run no longer holds its job; nothing to undo.
			_ = idempotency.Progress(ctx, int64(i+1), int64(len(pages)), "page "+pages[i])
		}
		return idempotency.SetResult(ctx, export{File: "s3://exports/1.csv", Rows: rows})
	}
	// Outside a handler run by keel's worker there is no job to store it with.
	fmt.Println(errors.Is(handle(context.Background(), []string{"a", "b"}), idempotency.ErrNoJob))
	// Output:
	// true
}
