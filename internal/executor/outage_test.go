package executor_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/jobstore"
	"github.com/keeljobs/keel/internal/testenv"
	"github.com/keeljobs/keel/internal/testworker"
	"github.com/keeljobs/keel/migrate"
	"github.com/keeljobs/keel/retry"
	"github.com/keeljobs/keel/server"
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

// A brief ledger outage (a Postgres restart, a failover) costs the jobs
// delivered meanwhile about as long as it lasted, with the default
// settings: each delivery the ledger could not claim waits as long as the
// outage has lasted so far (a second at first), up to LedgerRetry, and is
// not charged an attempt.
func TestABriefLedgerOutageDelaysJobsAboutAsLongAsItLasts(t *testing.T) {
	b := setup(t) // for the package's Redis database and its turn
	ctx := context.Background()
	pg := testenv.StartPostgres(t)
	pool, err := pgxpool.New(ctx, pg.URL(""))
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	_, err = migrate.Up(ctx, pool)
	require.NoError(t, err)
	client, err := tasks.NewClient(tasks.ClientConfig{Redis: b.redis, Pool: pool})
	require.NoError(t, err)
	t.Cleanup(func() { client.Close() })

	mux := tasks.NewMux()
	tasks.Handle(mux, receipt, func(ctx context.Context, o order) error { return nil })
	// Default guard settings: LedgerRetry 10s.
	testworker.RunServer(t, server.Config{Redis: b.redis, Pool: pool, Concurrency: 4, ShutdownTimeout: 2 * time.Second,
		Logger: slog.New(slog.DiscardHandler)}, mux)
	warm, err := client.Enqueue(ctx, receipt.New(order{OrderID: "outage-warm"}))
	require.NoError(t, err)
	testworker.WaitStatus(t, jobstore.NewStore(client.Pool()), warm.Job.ID, idempotency.StatusSucceeded, 20*time.Second)
	const n = 4
	var ids []string
	for i := range n {
		// Due in two seconds: delivered while Postgres is down.
		res, err := client.Enqueue(ctx, receipt.New(order{OrderID: fmt.Sprint("outage-", i)}, tasks.Delay(2*time.Second)))
		require.NoError(t, err)
		require.True(t, res.Published)
		ids = append(ids, res.Job.ID)
	}
	down := time.Now()
	pg.Stop()

	insp := asynq.NewInspector(b.redis)
	defer insp.Close()
	// Every job delivered, refused for the outage and put back to wait.
	waits := map[string]time.Duration{}
	testenv.Eventually(t, 20*time.Second, func() bool {
		for _, id := range ids {
			if info, err := insp.GetTaskInfo(receipt.Queue(), id); err == nil && info.State == asynq.TaskStateRetry {
				// asynq keeps whole seconds: allow one.
				lasted := max(info.LastFailedAt.Sub(down), time.Second)
				waits[id] = info.NextProcessAt.Sub(info.LastFailedAt)
				require.LessOrEqual(t, waits[id], lasted+time.Second,
					"job %s waits %s for an outage %s old: %s", id, waits[id], lasted, info.LastErr)
			}
		}
		return len(waits) == n
	}, "the jobs were not delivered and put back during the outage")
	pg.Start()
	for _, id := range ids {
		j := testworker.WaitStatus(t, jobstore.NewStore(pool), id, idempotency.StatusSucceeded, 30*time.Second)
		require.Equal(t, 1, j.Attempts, "the outage was charged to job %s", id)
	}
	t.Logf("waits during the outage: %v; every job done %s after Postgres went down", waits, time.Since(down).Round(100*time.Millisecond))
}
