package guarantees_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/testenv"
	"github.com/keeljobs/keel/tasks"
)

var (
	// loopPoisonKind kills its worker as soon as its handler starts; its
	// waits may add up to 5 s.
	loopPoisonKind = tasks.Define[item]("hunt:loop_poison", tasks.MaxRetry(0), tasks.MaxWait(5*time.Second),
		tasks.Key(func(i item) string { return i.ID }))
	// hangKind ignores its context and never returns (a call without a
	// deadline to a host that black-holes it): keel gives it up after its
	// 1 s timeout, and it goes on.
	hangKind = tasks.Define[item]("hunt:hang", tasks.MaxRetry(0), tasks.Timeout(time.Second), tasks.Key(func(i item) string { return i.ID }))
)

func hungNeighbourHandlers(mux *tasks.Mux, pool *pgxpool.Pool) {
	tasks.Handle(mux, loopPoisonKind, killsItsWorker(pool, 0))
	tasks.Handle(mux, hangKind, func(ctx context.Context, i item) error {
		_ = started(ctx, pool)
		select {}
	})
}

// A poison job on workers where hung handlers keel gave up are always
// about (a steady trickle of them) does not kill workers for ever: its
// last run must run alone, never starts beside a hung handler, and the job
// ends, retired as a poison job or over its wait ceiling.
func TestAPoisonJobAmongHungHandlersStillEnds(t *testing.T) {
	e := setup(t)
	ctx := context.Background()
	stop := make(chan struct{})
	defer close(stop)
	go func() {
		for n := 0; ; n++ {
			select {
			case <-stop:
				return
			case <-time.After(500 * time.Millisecond):
			}
			_, _ = e.client.Enqueue(ctx, hangKind.New(item{ID: fmt.Sprintf("hang-%d", n)}))
		}
	}()
	w := e.startChild(t, "hung-neighbours")
	testenv.Eventually(t, 20*time.Second, func() bool {
		return e.count(t, `SELECT count(*) FROM keel_jobs WHERE kind = $1 AND status = 'dead'`, hangKind.Name()) > 0
	}, "no hung handler was given up")
	bad, err := e.client.Enqueue(ctx, loopPoisonKind.New(item{ID: "poison"}))
	require.NoError(t, err)
	var p idempotency.Job
	// Its runs come back from a dead worker only once the new one gave up a
	// hung handler: they never find a worker without one about.
	hungAbout := func(c *child) bool {
		return e.count(t, `SELECT count(*) FROM keel_jobs WHERE kind = $1 AND status = 'dead' AND last_holder LIKE $2`,
			hangKind.Name(), c.holds()) > 0
	}
	e.settleWhen(t, "hung-neighbours", hungAbout, 90*time.Second, func() (bool, string) {
		p, err = e.store.Get(ctx, bad.Job.ID)
		require.NoError(t, err)
		return p.Status == idempotency.StatusDead, fmt.Sprintf("the poison job never ended: %+v", p)
	}, w)
	require.LessOrEqual(t, e.count(t, `SELECT count(*) FROM started WHERE job_id = $1`, bad.Job.ID), 2,
		"the poison job (MaxRetry 0) killed its worker more than MaxRetry+2 times")
	require.Contains(t, []string{"crashed", "waited_too_long"}, p.ErrorClass, p.LastError)
}
