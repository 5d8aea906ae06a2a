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

var (
	// slowPoisonKind kills its worker 1 s after it starts; its budget of
	// seven runs is more than the four deaths at the gate an earlier keel
	// let a job without retries survive.
	slowPoisonKind = tasks.Define[item]("hunt:slow_poison", tasks.MaxRetry(6), tasks.Key(func(i item) string { return i.ID }))
	// loneKind is an innocent job without retries; it runs for 2 s, so
	// that its first run is still going when the poison job's kills it.
	loneKind = tasks.Define[item]("hunt:lone", tasks.MaxRetry(0), tasks.Key(func(i item) string { return i.ID }))
	// zombieKind ignores its timeout and, 3 s after keel gave it up (its
	// 1 s and the worker's 3 s grace), kills its worker (a leak that ends
	// in an OOM kill).
	zombieKind = tasks.Define[item]("hunt:zombie", tasks.MaxRetry(0), tasks.Timeout(time.Second), tasks.Key(func(i item) string { return i.ID }))
	// longKind is an innocent job without retries that runs for 8 s: one
	// that started beside a zombie would still run when it kills.
	longKind = tasks.Define[item]("hunt:long", tasks.MaxRetry(0), tasks.Key(func(i item) string { return i.ID }))
)

func neighbourHandlers(mux *tasks.Mux, pool *pgxpool.Pool) {
	tasks.Handle(mux, slowPoisonKind, killsItsWorker(pool, time.Second))
	tasks.Handle(mux, zombieKind, killsItsWorker(pool, 7*time.Second))
	tasks.Handle(mux, loneKind, finishesAfter(pool, 2*time.Second))
	tasks.Handle(mux, longKind, finishesAfter(pool, 8*time.Second))
}

// A poison job with a budget of seven runs, older than an innocent job
// without retries: after every restart the poison job's run starts first
// and the innocent one, whose last run must run alone, waits for it, again
// and again. However many times it dies waiting, it is not retired.
func TestManyDeathsWhileAJobWaitsToRunAloneStillCostItNothing(t *testing.T) {
	e := setup(t)
	ctx := context.Background()
	bad, err := e.client.Enqueue(ctx, slowPoisonKind.New(item{ID: "poison"}))
	require.NoError(t, err)
	lone, err := e.client.Enqueue(ctx, loneKind.New(item{ID: "innocent"}))
	require.NoError(t, err)
	w := e.startChild(t, "neighbours")

	var p, s idempotency.Job
	e.settle(t, "neighbours", 4*time.Minute, func() (bool, string) {
		p, err = e.store.Get(ctx, bad.Job.ID)
		require.NoError(t, err)
		s, err = e.store.Get(ctx, lone.Job.ID)
		require.NoError(t, err)
		return p.Status == idempotency.StatusDead && s.Status.Terminal() || s.Status == idempotency.StatusDead,
			fmt.Sprintf("poison %+v, innocent %+v", p, s)
	}, w)
	require.Equal(t, idempotency.StatusSucceeded, s.Status,
		"an innocent job that waited beside a poison job was retired: %s: %s", s.ErrorClass, s.LastError)
	require.Equal(t, 1, e.count(t, `SELECT count(*) FROM effects WHERE job_id = $1`, lone.Job.ID))
	require.Contains(t, p.LastError, "the last while it ran alone on its worker")
	require.LessOrEqual(t, e.count(t, `SELECT count(*) FROM started WHERE job_id = $1`, bad.Job.ID), 7,
		"the poison job ran beyond its budget")
}

// A handler keel gave up (it ignored its timeout) that later kills its
// worker does not get a job retired that had to run alone: the job waits
// for the hung handler to return, never starts beside it, and its death
// at the gate costs it nothing.
func TestAHungHandlerKeelGaveUpIsNotTakenForAnAloneRunsCrash(t *testing.T) {
	e := setup(t)
	ctx := context.Background()
	// Due while the zombie runs, before keel gives it up.
	victim, err := e.client.Enqueue(ctx, longKind.New(item{ID: "victim"}, tasks.Delay(2*time.Second)))
	require.NoError(t, err)
	// As the ledger has it after an earlier crash of the job: its last
	// run runs alone.
	_, err = e.pool.Exec(ctx, `UPDATE keel_jobs SET crashes = 1 WHERE id = $1`, victim.Job.ID)
	require.NoError(t, err)
	w := e.startChild(t, "neighbours")
	zombie, err := e.client.Enqueue(ctx, zombieKind.New(item{ID: "zombie"}))
	require.NoError(t, err)

	var s idempotency.Job
	e.settle(t, "neighbours", 2*time.Minute, func() (bool, string) {
		s, err = e.store.Get(ctx, victim.Job.ID)
		require.NoError(t, err)
		return s.Status.Terminal() || s.Status == idempotency.StatusDead, fmt.Sprintf("%+v", s)
	}, w)
	require.Equal(t, idempotency.StatusSucceeded, s.Status, "the job beside a hung handler was retired: %s: %s", s.ErrorClass, s.LastError)
	require.Equal(t, 1, e.count(t, `SELECT count(*) FROM started WHERE job_id = $1`, victim.Job.ID),
		"the job's last run started beside a hung handler keel gave up")
	require.Equal(t, 1, e.count(t, `SELECT count(*) FROM effects WHERE job_id = $1`, victim.Job.ID))
	require.Equal(t, 1, s.Attempts, "the worker's death while the job waited to run alone cost it an attempt")
	require.Equal(t, 1, e.count(t, `SELECT crashes FROM keel_jobs WHERE id = $1`, victim.Job.ID),
		"the job's death at the gate counted as its crash")
	require.GreaterOrEqual(t, e.count(t, `SELECT waited_ms FROM keel_jobs WHERE id = $1`, victim.Job.ID), 2000,
		"the lease its death at the gate lost is not counted as time waited")
	z, err := e.store.Get(ctx, zombie.Job.ID)
	require.NoError(t, err)
	require.Equal(t, "timeout", z.ErrorClass, "the hung job: %s", z.LastError)
}
