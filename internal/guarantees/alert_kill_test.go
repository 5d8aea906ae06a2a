package guarantees_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/testenv"
	"github.com/keeljobs/keel/outbox"
	"github.com/keeljobs/keel/retry"
	"github.com/keeljobs/keel/server"
	"github.com/keeljobs/keel/tasks"
)

// doomedKind dies at its first run; the death hook of the worker that runs
// it hangs (so that it can be killed inside it) when the key says so.
var doomedKind = tasks.Define[item]("hunt:doomed", tasks.MaxRetry(3), tasks.Key(func(i item) string { return i.ID }))

func doomedHandlers(cfg *server.Config, mux *tasks.Mux, pool *pgxpool.Pool) {
	tasks.Handle(mux, doomedKind, func(context.Context, item) error {
		return retry.Permanent(errors.New("no such customer"))
	})
	cfg.Guard.OnDead = func(ctx context.Context, e idempotency.DeadEvent) {
		if _, err := pool.Exec(ctx, `INSERT INTO hooks_entered (job_id) VALUES ($1)`, e.JobID); err != nil {
			panic(err)
		}
		if strings.Contains(e.BusinessKey, "hangs") {
			select {} // killed in here
		}
		if _, err := pool.Exec(ctx, `INSERT INTO alerts (job_id) VALUES ($1)`, e.JobID); err != nil {
			panic(err)
		}
	}
}

// A worker killed after a death committed and before its alert hook
// finished: the alert is owed in the ledger, and a reconciler pays it, once.
// A death its own worker alerted is not alerted again.
func TestADeathWhoseWorkerWasKilledBeforeItsAlertIsStillAlerted(t *testing.T) {
	e := setup(t)
	ctx := context.Background()
	_, err := e.pool.Exec(ctx, `CREATE TABLE hooks_entered (job_id text); CREATE TABLE alerts (job_id text)`)
	require.NoError(t, err)
	var (
		mu     sync.Mutex
		events []idempotency.DeadEvent
	)
	rec, err := outbox.NewReconciler(outbox.ReconcilerConfig{Pool: e.pool, Redis: e.redisOpt(), Grace: time.Millisecond,
		OnDead: func(_ context.Context, ev idempotency.DeadEvent) {
			mu.Lock()
			defer mu.Unlock()
			events = append(events, ev)
		}})
	require.NoError(t, err)
	defer rec.Close()
	alerted := func() []idempotency.DeadEvent {
		_, err := rec.Reconcile(ctx)
		require.NoError(t, err)
		mu.Lock()
		defer mu.Unlock()
		return append([]idempotency.DeadEvent(nil), events...)
	}

	hangs, err := e.client.Enqueue(ctx, doomedKind.New(item{ID: "hangs"}))
	require.NoError(t, err)
	w := e.startChild(t, "doomed")
	testenv.Eventually(t, 20*time.Second, func() bool {
		return e.count(t, `SELECT count(*) FROM hooks_entered WHERE job_id = $1`, hangs.Job.ID) == 1
	}, "the death hook never ran")
	require.NoError(t, w.cmd.Process.Signal(syscall.SIGKILL))
	<-w.exited
	j, err := e.store.Get(ctx, hangs.Job.ID)
	require.NoError(t, err)
	require.Equal(t, idempotency.StatusDead, j.Status)
	require.Zero(t, e.count(t, `SELECT count(*) FROM alerts`), "the hook finished before the kill")

	// A pass the killed worker's reconciler still holds (until Postgres
	// notices its session is gone) is skipped: the next one pays.
	var got []idempotency.DeadEvent
	testenv.Eventually(t, 10*time.Second, func() bool { got = alerted(); return len(got) > 0 }, "the death its worker never alerted")
	require.Len(t, got, 1, "the death its worker never alerted")
	require.Equal(t, idempotency.DeadEvent{JobID: hangs.Job.ID, Kind: doomedKind.Name(), Queue: j.Queue, BusinessKey: j.BusinessKey,
		Class: string(retry.ClassPermanent), Error: j.LastError, Attempts: 1}, got[0])
	require.Len(t, alerted(), 1, "an owed alert is paid once")
	require.Equal(t, uint64(1), rec.Stats().OwedAlerts)

	// The same worker, not killed: its own hook alerts, and nothing is owed.
	fine, err := e.client.Enqueue(ctx, doomedKind.New(item{ID: "fine"}))
	require.NoError(t, err)
	e.startChild(t, "doomed")
	testenv.Eventually(t, 20*time.Second, func() bool {
		return e.count(t, `SELECT count(*) FROM keel_jobs WHERE id = $1 AND status = 'dead' AND NOT alert_owed`, fine.Job.ID) == 1
	}, "the death was not recorded as alerted")
	require.Equal(t, 1, e.count(t, `SELECT count(*) FROM alerts WHERE job_id = $1`, fine.Job.ID))
	require.Len(t, alerted(), 1, "a death its worker alerted was alerted again")
}
