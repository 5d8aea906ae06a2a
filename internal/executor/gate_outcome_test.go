package executor_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/executor"
	"github.com/keeljobs/keel/internal/testenv"
	"github.com/keeljobs/keel/server"
	"github.com/keeljobs/keel/tasks"
)

var aloneOutcome = tasks.Define[order]("test:alone_outcome", tasks.MaxRetry(0), tasks.Key(func(o order) string { return o.OrderID }))

// A run recorded as alone (solo_run = run) must keep other runs out until
// its outcome is in the ledger: if the gate opens when its handler returns,
// a neighbour that kills the worker before the completion commits leaves
// the row running with solo_run = run, and the takeover retires the
// innocent job as `crashed`.
func TestTheGateStaysShutUntilTheAloneRunsOutcomeIsRecorded(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	returned := make(chan pgx.Tx, 1)
	mux := tasks.NewMux()
	tasks.Handle(mux, aloneOutcome, func(hctx context.Context, o order) error {
		// Hold the completion mark back (a slow round, a batch row a
		// producer holds, a ledger hiccup): lock the job's row elsewhere.
		tx, err := b.pool.Begin(ctx)
		if err != nil {
			return err
		}
		id, _ := idempotency.JobID(hctx)
		if _, err := tx.Exec(ctx, `SELECT 1 FROM keel_jobs WHERE id = $1 FOR UPDATE`, id); err != nil {
			return err
		}
		returned <- tx
		return nil
	})
	res, err := b.client.Enqueue(ctx, aloneOutcome.New(order{OrderID: "alone"}, tasks.Delay(time.Second)))
	require.NoError(t, err)
	_, err = b.pool.Exec(ctx, `UPDATE keel_jobs SET crashes = 1 WHERE id = $1`, res.Job.ID)
	require.NoError(t, err)
	var guard func() *executor.Guard
	b.startWorker(t, mux, func(c *server.Config) {
		c.DelayedTaskCheckInterval = 100 * time.Millisecond
		guard = executor.GuardMadeWith(&c.Guard)
	})
	var tx pgx.Tx
	select {
	case tx = <-returned:
	case <-time.After(20 * time.Second):
		t.Fatal("the job never ran")
	}
	defer tx.Rollback(ctx)
	// The handler has returned and the completion mark waits for the row:
	// a delivery of another job arriving now must not pass the gate.
	pid := int(tx.Conn().PgConn().PID())
	testenv.Eventually(t, 30*time.Second, func() bool {
		return b.count(t, `SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY (pg_blocking_pids(pid))`, pid) > 0
	}, "the completion mark never waited for the job's row")
	if guard().EnterGateForTest(ctx, 100*time.Millisecond) == nil {
		var status string
		var run, solo int
		require.NoError(t, b.pool.QueryRow(ctx, `SELECT status, run, solo_run FROM keel_jobs WHERE id = $1`, res.Job.ID).
			Scan(&status, &run, &solo))
		t.Fatalf("the gate let another handler start while the alone run's outcome was unwritten (%s, run %d, solo_run %d): "+
			"a crash now retires it as crashed", status, run, solo)
	}
	require.NoError(t, tx.Rollback(ctx))
	b.waitStatus(t, res.Job.ID, idempotency.StatusSucceeded, 10*time.Second)
}
