package keeltest_test

// This file is the handlers guide's (docs/handlers.md) "Adding your own
// task" and "Testing your handlers": if it stops compiling or passing, the
// guide is wrong.

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/testenv"
	"github.com/keeljobs/keel/keeltest"
	"github.com/keeljobs/keel/tasks"
)

type Welcome struct {
	UserID string `json:"user_id"`
}

var SendWelcome = tasks.Define[Welcome]("user:send_welcome",
	tasks.Queue("default"), tasks.MaxRetry(5),
	tasks.Key(func(w Welcome) string { return "user:" + w.UserID }))

func register(mux *tasks.Mux, pool *pgxpool.Pool) {
	tasks.Handle(mux, SendWelcome, func(ctx context.Context, w Welcome) error {
		// The local effect commits with the job's completion, or not at all.
		return idempotency.InTx(ctx, func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `INSERT INTO welcomes (user_id) VALUES ($1)`, w.UserID)
			return err
		})
	})
}

func TestAddingYourOwnTask(t *testing.T) {
	h := keeltest.New(t, keeltest.Options{RedisDB: testenv.DBKeeltest})
	ctx := context.Background()
	_, err := h.Pool.Exec(ctx, `CREATE TABLE welcomes (user_id text NOT NULL)`)
	require.NoError(t, err)

	// What a handler enqueues in its transaction is visible in it.
	tx, err := h.Pool.Begin(ctx)
	require.NoError(t, err)
	_, err = h.Client.EnqueueTx(ctx, tx, SendWelcome.New(Welcome{UserID: "7"}))
	require.NoError(t, err)
	keeltest.Enqueued(t, tx, "user:send_welcome", "user:7")
	require.NoError(t, tx.Rollback(ctx))
	keeltest.NotEnqueued(t, h.Pool, "user:send_welcome", "user:7")

	mux := tasks.NewMux()
	register(mux, h.Pool)
	job := h.Run(t, mux, SendWelcome.New(Welcome{UserID: "42"}))
	require.Equal(t, idempotency.StatusSucceeded, job.Status)
	h.Redeliver(t, job.ID) // a duplicate delivery changes nothing
	h.Drain(t, 10*time.Second)

	var n int
	require.NoError(t, h.Pool.QueryRow(ctx, `SELECT count(*) FROM welcomes WHERE user_id = '42'`).Scan(&n))
	require.Equal(t, 1, n)
}
