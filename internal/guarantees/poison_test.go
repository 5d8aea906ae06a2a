package guarantees_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/tasks"
)

type item struct {
	ID string `json:"id"`
}

var (
	// poisonKind kills its worker every time it runs, a moment after it
	// starts (an OOM kill, a fatal runtime error).
	poisonKind = tasks.Define[item]("hunt:poison", tasks.MaxRetry(1), tasks.Key(func(i item) string { return i.ID }))
	// slowKind is an innocent job that takes a few seconds and then commits
	// its effect.
	slowKind = tasks.Define[item]("hunt:slow", tasks.MaxRetry(1), tasks.Key(func(i item) string { return i.ID }))
)

func poisonHandlers(mux *tasks.Mux, pool *pgxpool.Pool) {
	tasks.Handle(mux, poisonKind, killsItsWorker(pool, 300*time.Millisecond))
	tasks.Handle(mux, slowKind, finishesAfter(pool, 3*time.Second))
}

// A poison job retires after its budget; a job that merely ran beside it
// on the workers it killed did nothing wrong and must not be retired as a
// poison job with it.
func TestPoisonJobDoesNotRetireItsNeighbours(t *testing.T) {
	e := setup(t)
	ctx := context.Background()
	slow, err := e.client.Enqueue(ctx, slowKind.New(item{ID: "innocent"}))
	require.NoError(t, err)

	w := e.startChild(t, "poison")
	// The poison job arrives while the innocent one runs.
	require.Eventually(t, func() bool {
		return e.count(t, `SELECT count(*) FROM started WHERE job_id = $1`, slow.Job.ID) == 1
	}, 20*time.Second, 20*time.Millisecond)
	bad, err := e.client.Enqueue(ctx, poisonKind.New(item{ID: "poison"}))
	require.NoError(t, err)

	// Each worker the poison job kills is replaced at once, as a supervisor
	// does.
	var p, s idempotency.Job
	e.settle(t, "poison", 2*time.Minute, func() (bool, string) {
		p, err = e.store.Get(ctx, bad.Job.ID)
		require.NoError(t, err)
		s, err = e.store.Get(ctx, slow.Job.ID)
		require.NoError(t, err)
		return (p.Status.Terminal() || p.Status == idempotency.StatusDead) &&
				(s.Status == idempotency.StatusSucceeded || s.Status == idempotency.StatusDead),
			fmt.Sprintf("poison %+v, innocent %+v", p, s)
	}, w)
	require.Equal(t, idempotency.StatusDead, p.Status, "the poison job: %+v", p)
	require.Equal(t, idempotency.StatusSucceeded, s.Status,
		"an innocent job that ran beside a poison job was retired with it: %s: %s", s.ErrorClass, s.LastError)
	require.Equal(t, 2, e.count(t, `SELECT count(*) FROM started WHERE job_id = $1`, bad.Job.ID),
		"the poison job ran beyond its budget")
	require.Contains(t, p.LastError, "the last while it ran alone on its worker")
	require.Equal(t, 1, e.count(t, `SELECT count(*) FROM effects WHERE job_id = $1`, slow.Job.ID))
}
