package guarantees_test

import (
	"context"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/testenv"
	"github.com/keeljobs/keel/tasks"
)

// oneShotKind has no retries; its first run is still going when its worker
// is killed (a deploy whose grace ran out, an OOM kill caused by another
// job), and any later run finishes.
var oneShotKind = tasks.Define[item]("hunt:one_shot", tasks.MaxRetry(0), tasks.Key(func(i item) string { return i.ID }))

func oneShotHandlers(mux *tasks.Mux, pool *pgxpool.Pool) {
	tasks.Handle(mux, oneShotKind, func(ctx context.Context, i item) error {
		if err := started(ctx, pool); err != nil {
			return err
		}
		if idempotency.Attempt(ctx) == 1 {
			<-ctx.Done()
			return ctx.Err()
		}
		return effect(ctx)
	})
}

// A job without retries whose worker was killed under it once is not a
// poison job: it runs once more, alone on its worker, and finishes. Only a
// crash while it runs alone would retire it.
func TestAJobWithoutRetriesSurvivesItsWorkerBeingKilledOnce(t *testing.T) {
	e := setup(t)
	ctx := context.Background()
	res, err := e.client.Enqueue(ctx, oneShotKind.New(item{ID: "killed-once"}))
	require.NoError(t, err)

	w := e.startChild(t, "one-shot")
	testenv.Eventually(t, 20*time.Second, func() bool {
		return e.count(t, `SELECT count(*) FROM started WHERE job_id = $1`, res.Job.ID) == 1
	}, "the job never started")
	require.NoError(t, w.cmd.Process.Signal(syscall.SIGKILL))
	e.replace(t, "one-shot", w)

	testenv.Eventually(t, 60*time.Second, func() bool {
		j, err := e.store.Get(ctx, res.Job.ID)
		require.NoError(t, err)
		require.NotEqual(t, idempotency.StatusDead, j.Status, "retired as a poison job: %s", j.LastError)
		return j.Status == idempotency.StatusSucceeded
	}, "the job never finished")
	require.Equal(t, 2, e.count(t, `SELECT count(*) FROM started WHERE job_id = $1`, res.Job.ID))
	require.Equal(t, 1, e.count(t, `SELECT count(*) FROM effects WHERE job_id = $1`, res.Job.ID))
	require.Equal(t, 1, e.count(t, `SELECT extra_runs FROM keel_jobs WHERE id = $1`, res.Job.ID))
}
