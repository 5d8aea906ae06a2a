package idempotency_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/retry"
	"github.com/keeljobs/keel/tasks"
)

// A ledger connection cut under a handler's InTx (Postgres restarting, a
// failover, pg_terminate_backend) is the ledger's outage, not the job's
// failure: the job waits and runs again, its attempt not counted, and its
// effect commits once.
func TestLedgerConnectionCutInTxIsAWait(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	var runs atomic.Int32
	errs := make(chan error, 2)
	mux := tasks.NewMux()
	tasks.Handle(mux, receipt, func(ctx context.Context, o order) error {
		first := runs.Add(1) == 1
		err := idempotency.InTx(ctx, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, `INSERT INTO effects (job_id, name) VALUES ($1, 'intx')`, o.OrderID); err != nil {
				return err
			}
			if first {
				// Cut this transaction's own connection, as an operator
				// or a failover would.
				var pid int
				if err := tx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
					return err
				}
				if _, err := b.pool.Exec(ctx, `SELECT pg_terminate_backend($1)`, pid); err != nil {
					return err
				}
				_, err := tx.Exec(ctx, `SELECT 1`)
				return err
			}
			return nil
		})
		errs <- err
		return err
	})
	res, err := b.client.Enqueue(ctx, receipt.New(order{OrderID: "cut"}))
	require.NoError(t, err)
	b.startWorker(t, mux, nil)

	first := <-errs
	require.ErrorIs(t, first, idempotency.ErrLedgerUnavailable)
	require.True(t, retry.IsWait(first), "a cut ledger connection must be a wait, got %v", first)
	j := b.waitStatus(t, res.Job.ID, idempotency.StatusSucceeded, 30*time.Second)
	require.NoError(t, <-errs)
	require.Equal(t, 1, j.Attempts, "the cut connection used up an attempt")
	require.Zero(t, b.count(t, `SELECT crashes FROM keel_jobs WHERE id = $1`, res.Job.ID))
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM effects WHERE job_id = 'cut'`))
}

// An error fn classes itself is left as fn said, connection or not.
func TestInTxKeepsTheClassFnGave(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	mux := tasks.NewMux()
	tasks.Handle(mux, receipt, func(ctx context.Context, o order) error {
		return idempotency.InTx(ctx, func(tx pgx.Tx) error {
			var pid int
			if err := tx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
				return err
			}
			if _, err := b.pool.Exec(ctx, `SELECT pg_terminate_backend($1)`, pid); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, `SELECT 1`)
			if err == nil {
				err = errors.New("the connection survived")
			}
			return retry.Permanent(err)
		})
	})
	res, err := b.client.Enqueue(ctx, receipt.New(order{OrderID: "classed"}))
	require.NoError(t, err)
	b.startWorker(t, mux, nil)
	j := b.waitStatus(t, res.Job.ID, idempotency.StatusDead, 30*time.Second)
	require.Equal(t, string(retry.ClassPermanent), j.ErrorClass)
}
