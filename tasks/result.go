package tasks

import (
	"context"

	"github.com/keeljobs/keel/idempotency"
)

// Result reads job id's result, which its handler stored with
// idempotency.SetResult: idempotency.ErrNotFound without such a job,
// idempotency.ErrNoResult (naming the job's status) when it has none — it
// has not succeeded yet (Inspector().WaitDone waits for its end), or its
// handler stored none. A result is there exactly when the job succeeded
// with one.
func (c *Client) Result(ctx context.Context, id string) (idempotency.JobResult, error) {
	return c.store.Result(ctx, id)
}

// ResultByKey is Result for the job of kind with business key.
func (c *Client) ResultByKey(ctx context.Context, kind, key string) (idempotency.JobResult, error) {
	return c.store.ResultByKey(ctx, kind, key)
}

// ResultAs decodes what Result or ResultByKey returned into an R:
//
//	inv, err := tasks.ResultAs[Invoice](client.Result(ctx, id))
func ResultAs[R any](r idempotency.JobResult, err error) (R, error) {
	var v R
	if err != nil {
		return v, err
	}
	err = r.Decode(&v)
	return v, err
}
