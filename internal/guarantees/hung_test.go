package guarantees_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/testenv"
	"github.com/keeljobs/keel/internal/testworker"
	"github.com/keeljobs/keel/retry"
	"github.com/keeljobs/keel/server"
	"github.com/keeljobs/keel/tasks"
)

var (
	// hungInTx hangs inside its completing InTx, ignoring its context (a
	// call without a timeout, a lock wait in the handler's own code).
	hungInTx = tasks.Define[item]("hunt:hung_in_tx", tasks.MaxRetry(0), tasks.Timeout(time.Second),
		tasks.Key(func(i item) string { return i.ID }))
	quick = tasks.Define[item]("hunt:quick", tasks.Key(func(i item) string { return i.ID }))
)

// Handlers that hang inside InTx past their timeout are given up as
// timeouts, and the worker goes on running other jobs: the hung
// goroutines' open transactions must not leave keel unable to record
// anything. The pool has pgxpool's default size on a two-core host, as
// the worker command's pool has there.
func TestHandlersHungInsideInTxDoNotWedgeTheWorker(t *testing.T) {
	e := setup(t)
	ctx := context.Background()
	cfg, err := pgxpool.ParseConfig(testenv.URL(schema))
	require.NoError(t, err)
	cfg.MaxConns = 4
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	release := make(chan struct{})
	t.Cleanup(func() {
		close(release)
		pool.Close()
	})

	mux := tasks.NewMux()
	tasks.Handle(mux, hungInTx, func(ctx context.Context, i item) error {
		return idempotency.InTx(ctx, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, `INSERT INTO effects (job_id) VALUES ($1)`, i.ID); err != nil {
				return err
			}
			<-release // ignores ctx
			return nil
		})
	})
	tasks.Handle(mux, quick, func(ctx context.Context, i item) error {
		return idempotency.InTx(ctx, func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `INSERT INTO effects (job_id) VALUES ($1)`, i.ID)
			return err
		})
	})
	scfg := server.Config{Redis: e.redisOpt(), Pool: pool, Concurrency: 20, ShutdownTimeout: time.Second}
	testworker.RunServer(t, scfg, mux)

	var hung []string
	for _, id := range []string{"h1", "h2", "h3", "h4"} {
		r, err := e.client.Enqueue(ctx, hungInTx.New(item{ID: id}))
		require.NoError(t, err)
		hung = append(hung, r.Job.ID)
	}
	ok, err := e.client.Enqueue(ctx, quick.New(item{ID: "q1"}))
	require.NoError(t, err)

	for _, id := range hung {
		j := testworker.WaitStatus(t, e.store, id, idempotency.StatusDead, 30*time.Second)
		require.Equal(t, string(retry.ClassTimeout), j.ErrorClass, "job %s: %s", id, j.LastError)
	}
	testworker.WaitStatus(t, e.store, ok.Job.ID, idempotency.StatusSucceeded, 30*time.Second)
}
