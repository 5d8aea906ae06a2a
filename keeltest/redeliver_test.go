package keeltest_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/testenv"
	"github.com/keeljobs/keel/keeltest"
	"github.com/keeljobs/keel/tasks"
)

var slowReturn = tasks.Define[Welcome]("user:slow_return", tasks.Key(func(w Welcome) string { return "user:" + w.UserID }))

// The ledger records a job succeeded when InTx commits; asynq lets go of its
// copy only when the handler returns. A Redeliver in between waits for that
// instead of failing on asynq's copy still running.
func TestRedeliverRightAfterTheLedgerSaysSucceeded(t *testing.T) {
	h := keeltest.New(t, keeltest.Options{RedisDB: testenv.DBKeeltest})
	ctx := context.Background()
	_, err := h.Pool.Exec(ctx, `CREATE TABLE welcomes (user_id text NOT NULL)`)
	require.NoError(t, err)
	release := make(chan struct{})
	mux := tasks.NewMux()
	tasks.Handle(mux, slowReturn, func(ctx context.Context, w Welcome) error {
		err := idempotency.InTx(ctx, func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `INSERT INTO welcomes (user_id) VALUES ($1)`, w.UserID)
			return err
		})
		<-release
		return err
	})
	res, err := h.Client.Enqueue(ctx, slowReturn.New(Welcome{UserID: "9"}))
	require.NoError(t, err)
	h.Worker(t, mux)
	h.Wait(t, res.Job.ID, 10*time.Second, idempotency.StatusSucceeded)
	// The handler returns, and asynq lets go of its copy, only once
	// Redeliver has found that copy still running: the case under test.
	var once sync.Once
	releaseOnce := func() { once.Do(func() { close(release) }) }
	defer releaseOnce()
	keeltest.OnRedeliverWait(h, releaseOnce)
	h.Redeliver(t, res.Job.ID)
	h.Drain(t, 10*time.Second)
	var n int
	require.NoError(t, h.Pool.QueryRow(ctx, `SELECT count(*) FROM welcomes WHERE user_id = '9'`).Scan(&n))
	require.Equal(t, 1, n)
}
