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
	e := setupAlone(t)
	ctx := context.Background()
	cfg, err := pgxpool.ParseConfig(testenv.URL(e.schema))
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
	// A lease shorter than the timeout, its grace and a ledger write's
	// wait for a connection together: the hung runs' connections must be
	// freed before anything else is written, or the renewals find none,
	// the leases run out and the rescuer counts crashes.
	scfg.Guard.Lease = 4 * time.Second
	scfg.Guard.TimeoutGrace = time.Second
	srv := testworker.RunServer(t, scfg, mux)

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
		require.Equal(t, 1, j.Attempts, "job %s: one run, given up at its timeout, no crash", id)
		require.Zero(t, j.ExtraRuns, "job %s: its lease never ran out", id)
	}
	testworker.WaitStatus(t, e.store, ok.Job.ID, idempotency.StatusSucceeded, 30*time.Second)
	// Every write but a renewal found a connection: the stray marks and the
	// failures come after the hung runs' connections are dropped. A renewal
	// that began just after the runs took the pool waits up to a third of
	// the lease for one, and on a slow host may not get it: the next tick
	// renews in time, which no extra run above shows.
	st := srv.GuardStats()
	require.Equal(t, st.RenewalsMissed, st.LedgerErrors, "ledger writes failed while the hung runs held the pool")
}

var (
	hungCancelled = tasks.Define[item]("hunt:hung_cancelled", tasks.Timeout(time.Minute),
		tasks.Key(func(i item) string { return i.ID }))
	bump = tasks.Define[item]("hunt:bump", tasks.Key(func(i item) string { return i.ID }))
)

// A cancelled run hung inside InTx (ignoring its context) lets go of its
// transaction at once, as a run given up at its timeout does: the row it
// locked must not stop the next job that writes it.
func TestCancelledRunHungInsideInTxLetsGoOfItsLocks(t *testing.T) {
	e := setup(t)
	ctx := context.Background()
	_, err := e.pool.Exec(ctx, `CREATE TABLE hung_counter (id int PRIMARY KEY, n int NOT NULL); INSERT INTO hung_counter VALUES (1, 0)`)
	require.NoError(t, err)
	release := make(chan struct{})
	t.Cleanup(func() { close(release) })
	inside := make(chan struct{}, 1)
	mux := tasks.NewMux()
	tasks.Handle(mux, hungCancelled, func(ctx context.Context, i item) error {
		return idempotency.InTx(ctx, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, `UPDATE hung_counter SET n = n + 1 WHERE id = 1`); err != nil {
				return err
			}
			inside <- struct{}{}
			<-release // ignores ctx
			return nil
		})
	})
	tasks.Handle(mux, bump, func(ctx context.Context, i item) error {
		return idempotency.InTx(ctx, func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `UPDATE hung_counter SET n = n + 10 WHERE id = 1`)
			return err
		})
	})
	srv := testworker.RunServer(t, server.Config{Redis: e.redisOpt(), Pool: e.pool, Concurrency: 5, ShutdownTimeout: time.Second}, mux)

	hung, err := e.client.Enqueue(ctx, hungCancelled.New(item{ID: "c1"}))
	require.NoError(t, err)
	select {
	case <-inside:
	case <-time.After(20 * time.Second):
		t.Fatal("the hung run never started")
	}
	_, err = e.client.Cancel(ctx, hung.Job.ID)
	require.NoError(t, err)
	next, err := e.client.Enqueue(ctx, bump.New(item{ID: "after-cancel"}))
	require.NoError(t, err)
	testworker.WaitStatus(t, e.store, next.Job.ID, idempotency.StatusSucceeded, 20*time.Second)
	j, err := e.store.Get(ctx, hung.Job.ID)
	require.NoError(t, err)
	require.Equal(t, idempotency.StatusCancelled, j.Status)
	var n int
	require.NoError(t, e.pool.QueryRow(ctx, `SELECT n FROM hung_counter WHERE id = 1`).Scan(&n))
	require.Equal(t, 10, n, "the cancelled run's update was rolled back, the next job's committed")
	require.Zero(t, srv.GuardStats().LedgerErrors)
}
