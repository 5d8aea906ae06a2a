package guarantees_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/inspect"
	"github.com/keeljobs/keel/internal/testenv"
	"github.com/keeljobs/keel/internal/testworker"
	"github.com/keeljobs/keel/retry"
	"github.com/keeljobs/keel/server"
	"github.com/keeljobs/keel/tasks"
)

// depKind's handler does what its key says; every run of every job first
// records whether a parent of it had not succeeded yet (early), which no
// run may ever see.
var depKind = tasks.Define[item]("hunt:dep", tasks.MaxRetry(3), tasks.Key(func(i item) string { return i.ID }))

func depsTables(t *testing.T, e *env) {
	t.Helper()
	_, err := e.pool.Exec(context.Background(), `CREATE TABLE early (job_id text, parent text);
		CREATE TABLE failed_once (job_id text PRIMARY KEY)`)
	require.NoError(t, err)
}

// depHandler: keys starting "commit-then-hang" commit their effect and then
// hang (a worker killed at completion); "hang-first" hang in their first
// run and commit in the next; "fail-once" die at their first run
// (permanently) and succeed once replayed; "effects-then-fail" commit
// their effect and then fail (dead, the effect in); "gate" wait on gate. Every
// other key commits its effect.
func depHandler(pool *pgxpool.Pool, gate func(ctx context.Context, key string) error) func(context.Context, item) error {
	return func(ctx context.Context, it item) error {
		id, _ := idempotency.JobID(ctx)
		if _, err := pool.Exec(ctx, `INSERT INTO early (job_id, parent)
			SELECT $1, d.parent_id FROM keel_job_deps d JOIN keel_jobs p ON p.id = d.parent_id
			WHERE d.child_id = $1 AND p.status <> 'succeeded'`, id); err != nil {
			return err
		}
		if err := started(ctx, pool); err != nil {
			return err
		}
		switch {
		case strings.HasPrefix(it.ID, "commit-then-hang"):
			if err := effect(ctx); err != nil {
				return err
			}
			select {} // killed in here
		case strings.HasPrefix(it.ID, "hang-first"):
			var runs int
			if err := pool.QueryRow(ctx, `SELECT count(*) FROM started WHERE job_id = $1`, id).Scan(&runs); err != nil {
				return err
			}
			if runs == 1 {
				select {} // killed in here
			}
		case strings.HasPrefix(it.ID, "fail-once"):
			tag, err := pool.Exec(ctx, `INSERT INTO failed_once (job_id) VALUES ($1) ON CONFLICT DO NOTHING`, id)
			if err != nil {
				return err
			}
			if tag.RowsAffected() == 1 {
				return retry.Permanent(errors.New("the warehouse refused"))
			}
		case strings.HasPrefix(it.ID, "effects-then-fail"):
			// Dead after its completing InTx: its effect is in.
			if err := effect(ctx); err != nil {
				return err
			}
			return retry.Permanent(errors.New("the label printer jammed after the commit"))
		case strings.HasPrefix(it.ID, "gate") && gate != nil:
			if err := gate(ctx, it.ID); err != nil {
				return err
			}
		}
		return effect(ctx)
	}
}

func depsHandlers(mux *tasks.Mux, pool *pgxpool.Pool) {
	tasks.Handle(mux, depKind, depHandler(pool, nil))
}

// depsWorker runs a worker in the test's process on queues.
func depsWorker(t *testing.T, e *env, queues map[string]int, gate func(context.Context, string) error) {
	t.Helper()
	mux := tasks.NewMux()
	tasks.Handle(mux, depKind, depHandler(e.pool, gate))
	cfg := server.Config{Redis: e.redisOpt(), Pool: e.pool, Queues: queues, Concurrency: 4, ShutdownTimeout: time.Second}
	cfg.Reconciler.Interval, cfg.Reconciler.Grace = 200*time.Millisecond, 200*time.Millisecond
	testworker.RunServer(t, cfg, mux)
}

func (e *env) effects(t *testing.T, id string) int {
	t.Helper()
	return e.count(t, `SELECT count(*) FROM effects WHERE job_id = $1`, id)
}

func (e *env) noEarlyRuns(t *testing.T) {
	t.Helper()
	require.Zero(t, e.count(t, `SELECT count(*) FROM early`), "a job ran before a parent of it had succeeded")
}

// The last two parents of a job succeed at the same moment on two workers
// (each reads its own queue): the child is released by exactly one of the
// two transactions, and runs once, after both.
func TestTheLastTwoParentsFinishingAtOnceReleaseTheirChildOnce(t *testing.T) {
	e := setup(t)
	depsTables(t, e)
	ctx := context.Background()
	const rounds = 6
	var mu sync.Mutex
	arrived := map[string]chan struct{}{}
	// A round's parents start once its child is enqueued (else they might
	// succeed before it, and it would never wait).
	enqueued := map[string]chan struct{}{}
	for r := range rounds {
		enqueued[fmt.Sprintf("gate%d", r)] = make(chan struct{})
	}
	// Both parents of a round wait for each other, then commit together.
	gate := func(ctx context.Context, key string) error {
		round := key[:strings.LastIndex(key, "-")]
		select {
		case <-enqueued[round]:
		case <-ctx.Done():
			return ctx.Err()
		}
		mu.Lock()
		ch, ok := arrived[round]
		if !ok {
			ch = make(chan struct{})
			arrived[round] = ch
		}
		mu.Unlock()
		if ok {
			close(ch)
			return nil
		}
		select {
		case <-ch:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	depsWorker(t, e, map[string]int{"critical": 1}, gate)
	depsWorker(t, e, map[string]int{"low": 1}, gate)

	var children []string
	for r := range rounds {
		a, err := e.client.Enqueue(ctx, depKind.New(item{ID: fmt.Sprintf("gate%d-a", r)}, tasks.Queue("critical")))
		require.NoError(t, err)
		b, err := e.client.Enqueue(ctx, depKind.New(item{ID: fmt.Sprintf("gate%d-b", r)}, tasks.Queue("low")))
		require.NoError(t, err)
		c, err := e.client.Enqueue(ctx, depKind.New(item{ID: fmt.Sprintf("child%d", r)}, tasks.Queue("low"), tasks.After(a.Job.ID, b.Job.ID)))
		require.NoError(t, err)
		require.Equal(t, idempotency.StatusWaiting, c.Job.Status)
		require.Equal(t, 2, c.Job.WaitingOn)
		require.False(t, c.Published)
		close(enqueued[fmt.Sprintf("gate%d", r)])
		children = append(children, c.Job.ID)
	}
	for _, id := range children {
		testworker.WaitStatus(t, e.store, id, idempotency.StatusSucceeded, 30*time.Second)
	}
	for _, id := range children {
		require.Equal(t, 1, e.effects(t, id), "child %s ran its effect once", id)
		require.Equal(t, 1, e.count(t, `SELECT count(*) FROM started WHERE job_id = $1`, id), "child %s ran once", id)
	}
	e.noEarlyRuns(t)
	require.Zero(t, e.count(t, `SELECT count(*) FROM keel_outbox`))
}

// A parent's worker is killed right after the parent's completing InTx
// committed (its success released the child in that transaction), and
// another parent's worker is killed before its completion: the first is
// not run again, the second is, and the child runs once, after both.
func TestADependentIsReleasedOnceThroughKillsAtItsParentsCompletion(t *testing.T) {
	e := setup(t)
	depsTables(t, e)
	ctx := context.Background()
	p1, err := e.client.Enqueue(ctx, depKind.New(item{ID: "commit-then-hang"}))
	require.NoError(t, err)
	p2, err := e.client.Enqueue(ctx, depKind.New(item{ID: "hang-first"}))
	require.NoError(t, err)
	c, err := e.client.Enqueue(ctx, depKind.New(item{ID: "after-both"}, tasks.After(p1.Job.ID, p2.Job.ID)))
	require.NoError(t, err)

	w := e.startChild(t, "deps")
	testworker.WaitStatus(t, e.store, p1.Job.ID, idempotency.StatusSucceeded, 20*time.Second)
	testenv.Eventually(t, 20*time.Second, func() bool {
		return e.count(t, `SELECT count(*) FROM started WHERE job_id = $1`, p2.Job.ID) == 1
	}, "the second parent never started")
	j, err := e.store.Get(ctx, c.Job.ID)
	require.NoError(t, err)
	require.Equal(t, idempotency.StatusWaiting, j.Status, "released before its second parent succeeded")
	require.Equal(t, 1, j.WaitingOn)
	require.NoError(t, w.cmd.Process.Signal(syscall.SIGKILL))

	e.settle(t, "deps", 60*time.Second, func() (bool, string) {
		j, err := e.store.Get(ctx, c.Job.ID)
		require.NoError(t, err)
		return j.Status == idempotency.StatusSucceeded, string(j.Status)
	}, w)
	require.Equal(t, 1, e.effects(t, p1.Job.ID), "the parent killed after its commit ran its effect again")
	require.Equal(t, 1, e.effects(t, p2.Job.ID))
	require.Equal(t, 1, e.effects(t, c.Job.ID), "the child ran its effect more than once")
	require.Equal(t, 1, e.count(t, `SELECT count(*) FROM started WHERE job_id = $1`, c.Job.ID))
	e.noEarlyRuns(t)
}

// Redis loses everything while a job waits for its parent: the reconciler
// publishes the parent again and never the waiting child, whose release
// then runs it once.
func TestAWaitingJobSurvivesAFlushedRedisAndRunsOnce(t *testing.T) {
	e := setup(t)
	depsTables(t, e)
	ctx := context.Background()
	p, err := e.client.Enqueue(ctx, depKind.New(item{ID: "parent"}))
	require.NoError(t, err)
	require.True(t, p.Published)
	c, err := e.client.Enqueue(ctx, depKind.New(item{ID: "child"}, tasks.AfterKey(depKind.Name(), "parent")))
	require.NoError(t, err)
	rdb := redis.NewClient(&redis.Options{Addr: e.redis.Addr()})
	defer rdb.Close()
	require.NoError(t, rdb.FlushAll(ctx).Err())

	depsWorker(t, e, nil, nil)
	testworker.WaitStatus(t, e.store, c.Job.ID, idempotency.StatusSucceeded, 30*time.Second)
	require.Equal(t, 1, e.effects(t, p.Job.ID))
	require.Equal(t, 1, e.effects(t, c.Job.ID))
	e.noEarlyRuns(t)
}

// A parent that dies leaves its child waiting, and says why; replaying the
// parent to success releases the child, which runs once.
func TestAReplayedParentReleasesItsWaitingChild(t *testing.T) {
	e := setup(t)
	depsTables(t, e)
	ctx := context.Background()
	p, err := e.client.Enqueue(ctx, depKind.New(item{ID: "fail-once"}))
	require.NoError(t, err)
	c, err := e.client.Enqueue(ctx, depKind.New(item{ID: "after-fail"}, tasks.After(p.Job.ID)))
	require.NoError(t, err)
	depsWorker(t, e, nil, nil)
	testworker.WaitStatus(t, e.store, p.Job.ID, idempotency.StatusDead, 20*time.Second)

	ops := e.client.Inspector()
	d, err := ops.Dependencies(ctx, c.Job.ID)
	require.NoError(t, err)
	require.Len(t, d.Waits(), 1)
	require.Equal(t, p.Job.ID, d.Waits()[0].ID)
	require.Equal(t, idempotency.StatusDead, d.Waits()[0].Status)
	j, err := e.store.Get(ctx, c.Job.ID)
	require.NoError(t, err)
	require.Equal(t, idempotency.StatusWaiting, j.Status)

	_, err = ops.Replay(ctx, p.Job.ID, "ops", "the warehouse is back")
	require.NoError(t, err)
	testworker.WaitStatus(t, e.store, c.Job.ID, idempotency.StatusSucceeded, 20*time.Second)
	require.Equal(t, 1, e.effects(t, c.Job.ID))
	e.noEarlyRuns(t)
}

// Cancelling a parent cancels what waits for it, down the graph, each
// audited; a job released by hand runs without its parent.
func TestCancellingAParentCancelsItsWaitingDescendants(t *testing.T) {
	e := setup(t)
	depsTables(t, e)
	ctx := context.Background()
	p, err := e.client.Enqueue(ctx, depKind.New(item{ID: "p"}))
	require.NoError(t, err)
	c, err := e.client.Enqueue(ctx, depKind.New(item{ID: "c"}, tasks.After(p.Job.ID)))
	require.NoError(t, err)
	g, err := e.client.Enqueue(ctx, depKind.New(item{ID: "g"}, tasks.After(c.Job.ID)))
	require.NoError(t, err)
	other, err := e.client.Enqueue(ctx, depKind.New(item{ID: "other"}, tasks.After(p.Job.ID)))
	require.NoError(t, err)

	ops := e.client.Inspector()
	rel, err := ops.Release(ctx, other.Job.ID, "ops", "the report can go without the export")
	require.NoError(t, err)
	require.False(t, rel.AlreadyReleased)
	require.Equal(t, idempotency.StatusPending, rel.Job.Status)
	again, err := ops.Release(ctx, other.Job.ID, "ops", "twice")
	require.NoError(t, err)
	require.True(t, again.AlreadyReleased)

	_, err = e.client.Cancel(ctx, p.Job.ID, tasks.CancelBy("ops"), tasks.CancelNote("order withdrawn"))
	require.NoError(t, err)
	for _, id := range []string{c.Job.ID, g.Job.ID} {
		j, err := e.store.Get(ctx, id)
		require.NoError(t, err)
		require.Equal(t, idempotency.StatusCancelled, j.Status)
		require.Equal(t, "keel", j.ResolvedBy)
		audit, err := ops.Audit(ctx, id)
		require.NoError(t, err)
		require.Len(t, audit, 1)
		require.Equal(t, "cancel", audit[0].Action)
		require.Contains(t, audit[0].Note, "was cancelled")
	}
	_, err = ops.Release(ctx, c.Job.ID, "ops", "too late")
	var se *inspect.StatusError
	require.ErrorAs(t, err, &se)
	require.ErrorIs(t, err, inspect.ErrNotWaiting)

	depsWorker(t, e, nil, nil)
	testworker.WaitStatus(t, e.store, other.Job.ID, idempotency.StatusSucceeded, 20*time.Second)
	require.Equal(t, 1, e.effects(t, other.Job.ID))
	j, err := e.store.Get(ctx, p.Job.ID)
	require.NoError(t, err)
	require.Equal(t, idempotency.StatusCancelled, j.Status)
}

// What cannot be waited for is refused at enqueue, with nothing written.
func TestADependencyThatCannotBeMetIsRefused(t *testing.T) {
	e := setup(t)
	ctx := context.Background()
	p, err := e.client.Enqueue(ctx, depKind.New(item{ID: "to-cancel"}))
	require.NoError(t, err)
	_, err = e.client.Cancel(ctx, p.Job.ID)
	require.NoError(t, err)

	for name, c := range map[string]struct {
		t    *tasks.Task
		want error
	}{
		"unknown id":     {depKind.New(item{ID: "x1"}, tasks.After("0193a6a0-0000-7000-8000-000000000000")), tasks.ErrUnknownParent},
		"not an id":      {depKind.New(item{ID: "x2"}, tasks.After("order-7")), tasks.ErrUnknownParent},
		"unknown key":    {depKind.New(item{ID: "x3"}, tasks.AfterKey(depKind.Name(), "nobody")), tasks.ErrUnknownParent},
		"its own key":    {depKind.New(item{ID: "x4"}, tasks.AfterKey(depKind.Name(), "x4")), tasks.ErrUnknownParent},
		"cancelled":      {depKind.New(item{ID: "x5"}, tasks.After(p.Job.ID)), tasks.ErrParentEnded},
		"cancelled, key": {depKind.New(item{ID: "x6"}, tasks.AfterKey(depKind.Name(), "to-cancel")), tasks.ErrParentEnded},
	} {
		_, err := e.client.Enqueue(ctx, c.t)
		require.ErrorIs(t, err, c.want, name)
	}
	_, err = e.client.EnqueueMany(ctx, depKind.New(item{ID: "x7"}, tasks.After(p.Job.ID)))
	require.ErrorIs(t, err, tasks.ErrInvalidTask)

	cycle := tasks.NewWorkflow("loop").
		Add("a", depKind.New(item{ID: "wa"}), "c").
		Add("b", depKind.New(item{ID: "wb"}), "a").
		Add("c", depKind.New(item{ID: "wc"}), "b").
		Add("d", depKind.New(item{ID: "wd"}))
	_, err = e.client.EnqueueWorkflow(ctx, cycle)
	require.ErrorIs(t, err, tasks.ErrCycle)
	require.ErrorContains(t, err, "a, b, c")
	_, err = e.client.EnqueueWorkflow(ctx, tasks.NewWorkflow("self").Add("a", depKind.New(item{ID: "wa"}), "a"))
	require.ErrorIs(t, err, tasks.ErrCycle)
	_, err = e.client.EnqueueWorkflow(ctx, tasks.NewWorkflow("typo").Add("a", depKind.New(item{ID: "wa"}), "b"))
	require.ErrorIs(t, err, tasks.ErrInvalidTask)
	_, err = e.client.EnqueueWorkflow(ctx, tasks.NewWorkflow("twice").Add("a", depKind.New(item{ID: "wa"})).Add("a", depKind.New(item{ID: "wb"})))
	require.ErrorIs(t, err, tasks.ErrInvalidTask)
	// A workflow refused part-way writes nothing.
	_, err = e.client.EnqueueWorkflow(ctx, tasks.NewWorkflow("partial").
		Add("a", depKind.New(item{ID: "pa"})).
		Add("b", depKind.New(item{ID: "pb"}, tasks.After(p.Job.ID)), "a"))
	require.ErrorIs(t, err, tasks.ErrParentEnded)
	require.Equal(t, 1, e.count(t, `SELECT count(*) FROM keel_jobs`), "only the cancelled parent exists")
}

// A diamond workflow (a; b and c after a; d after both) runs each task
// once, in order; enqueueing it again changes nothing.
func TestAWorkflowRunsEachTaskOnceInOrder(t *testing.T) {
	e := setup(t)
	depsTables(t, e)
	ctx := context.Background()
	wf := func() *tasks.Workflow {
		return tasks.NewWorkflow("order-9").
			Add("charge", depKind.New(item{ID: "charge-9"})).
			Add("pack", depKind.New(item{ID: "pack-9"}), "charge").
			Add("invoice", depKind.New(item{ID: "invoice-9"}), "charge").
			Add("ship", depKind.New(item{ID: "ship-9"}), "pack", "invoice")
	}
	res, err := e.client.EnqueueWorkflow(ctx, wf())
	require.NoError(t, err)
	require.Len(t, res.Tasks, 4)
	require.Equal(t, idempotency.StatusPending, res.Tasks["charge"].Job.Status)
	require.Equal(t, idempotency.StatusWaiting, res.Tasks["ship"].Job.Status)
	require.Equal(t, 2, res.Tasks["ship"].Job.WaitingOn)

	depsWorker(t, e, nil, nil)
	testworker.WaitStatus(t, e.store, res.Tasks["ship"].Job.ID, idempotency.StatusSucceeded, 30*time.Second)
	for name, r := range res.Tasks {
		require.Equal(t, 1, e.effects(t, r.Job.ID), name)
	}
	e.noEarlyRuns(t)
	nodes, err := e.client.Inspector().Workflow(ctx, "order-9")
	require.NoError(t, err)
	require.Len(t, nodes, 4)
	for _, n := range nodes {
		require.Equal(t, idempotency.StatusSucceeded, n.Status, n.Task)
		if n.Task == "ship" {
			require.ElementsMatch(t, []string{res.Tasks["pack"].Job.ID, res.Tasks["invoice"].Job.ID}, n.Parents)
		}
	}

	again, err := e.client.EnqueueWorkflow(ctx, wf())
	require.NoError(t, err)
	for name, r := range again.Tasks {
		require.True(t, r.Existed, name)
		require.Equal(t, res.Tasks[name].Job.ID, r.Job.ID)
	}
	_, err = e.client.Inspector().Workflow(ctx, "no-such-workflow")
	require.ErrorIs(t, err, inspect.ErrNotFound)
}

// A job enqueued (EnqueueTx) to wait for a parent whose completion commits
// while the enqueue's transaction is still open: the parent's success
// waits for that transaction, so it sees the new child and releases it.
// Without the lock the child would count the parent as running, the
// parent's success would not see the uncommitted child, and the child
// would wait for ever.
func TestADependentEnqueuedWhileItsParentCompletesIsReleased(t *testing.T) {
	e := setup(t)
	depsTables(t, e)
	ctx := context.Background()
	open := make(chan struct{})
	depsWorker(t, e, nil, func(ctx context.Context, _ string) error {
		select {
		case <-open:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	})
	p, err := e.client.Enqueue(ctx, depKind.New(item{ID: "gate-parent"}))
	require.NoError(t, err)
	testenv.Eventually(t, 20*time.Second, func() bool {
		return e.count(t, `SELECT count(*) FROM started WHERE job_id = $1`, p.Job.ID) == 1
	}, "the parent never started")

	// A first child marks the parent as having dependents: the second's
	// enqueue then writes nothing to the parent's row, and only its lock
	// holds the parent's completion back.
	first, err := e.client.Enqueue(ctx, depKind.New(item{ID: "child-first"}, tasks.After(p.Job.ID)))
	require.NoError(t, err)

	tx, err := e.pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck
	var pid int
	require.NoError(t, tx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid))
	c, err := e.client.EnqueueTx(ctx, tx, depKind.New(item{ID: "child-in-tx"}, tasks.After(p.Job.ID)))
	require.NoError(t, err)
	require.Equal(t, idempotency.StatusWaiting, c.Job.Status)
	close(open)
	// The parent's completion reaches the ledger while the enqueue is
	// open: it either waits for it, or (without the lock) commits.
	testenv.Eventually(t, 20*time.Second, func() bool {
		return e.count(t, `SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY (pg_blocking_pids(pid))`, pid) > 0 ||
			e.count(t, `SELECT count(*) FROM keel_jobs WHERE id = $1 AND status = 'succeeded'`, p.Job.ID) == 1
	}, "the parent's completion never reached the ledger")
	require.NoError(t, tx.Commit(ctx))
	testworker.WaitStatus(t, e.store, c.Job.ID, idempotency.StatusSucceeded, 20*time.Second)
	testworker.WaitStatus(t, e.store, first.Job.ID, idempotency.StatusSucceeded, 20*time.Second)
	require.Equal(t, 1, e.effects(t, c.Job.ID))
	e.noEarlyRuns(t)
}

// sumKind's handler stores its key's number as its result, or, with
// parents, the sum of theirs, named by task.
var sumKind = tasks.Define[item]("hunt:sum", tasks.Key(func(i item) string { return i.ID }))

// A fan-in reads what each branch stored as its result.
func TestAJobReadsItsParentsResults(t *testing.T) {
	e := setup(t)
	ctx := context.Background()
	mux := tasks.NewMux()
	tasks.Handle(mux, sumKind, func(ctx context.Context, it item) error {
		ps, err := idempotency.ParentResults(ctx)
		if err != nil {
			return err
		}
		if len(ps) == 0 {
			return idempotency.SetResult(ctx, len(it.ID))
		}
		sum, by := 0, map[string]int{}
		for _, p := range ps {
			var n int
			if err := p.Decode(&n); err != nil {
				return err
			}
			sum, by[p.Task] = sum+n, n
		}
		return idempotency.SetResult(ctx, map[string]any{"sum": sum, "by": by})
	})
	cfg := server.Config{Redis: e.redisOpt(), Pool: e.pool, Concurrency: 4, ShutdownTimeout: time.Second}
	testworker.RunServer(t, cfg, mux)
	res, err := e.client.EnqueueWorkflow(ctx, tasks.NewWorkflow("sums").
		Add("three", sumKind.New(item{ID: "abc"})).
		Add("five", sumKind.New(item{ID: "abcde"})).
		Add("total", sumKind.New(item{ID: "total"}), "three", "five"))
	require.NoError(t, err)
	total := res.Tasks["total"].Job.ID
	testworker.WaitStatus(t, e.store, total, idempotency.StatusSucceeded, 20*time.Second)
	r, err := e.client.Result(ctx, total)
	require.NoError(t, err)
	require.JSONEq(t, `{"sum": 8, "by": {"three": 3, "five": 5}}`, string(r.JSON))
}

// A parent whose handler failed after its completing InTx (dead, its
// effects in) has met the dependency of what waits for it: a job enqueued
// after it then does not wait for it, and discarding it does not cancel a
// child that still waits for another parent.
func TestAParentDeadWithItsEffectsInHasMetItsDependency(t *testing.T) {
	e := setup(t)
	depsTables(t, e)
	ctx := context.Background()
	open := make(chan struct{})
	p, err := e.client.Enqueue(ctx, depKind.New(item{ID: "effects-then-fail"}))
	require.NoError(t, err)
	q, err := e.client.Enqueue(ctx, depKind.New(item{ID: "gate-q"}))
	require.NoError(t, err)
	c, err := e.client.Enqueue(ctx, depKind.New(item{ID: "after-both"}, tasks.After(p.Job.ID, q.Job.ID)))
	require.NoError(t, err)
	depsWorker(t, e, nil, func(ctx context.Context, _ string) error {
		select {
		case <-open:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	})
	testworker.WaitStatus(t, e.store, p.Job.ID, idempotency.StatusDead, 20*time.Second)
	require.Equal(t, 1, e.effects(t, p.Job.ID))

	late, err := e.client.Enqueue(ctx, depKind.New(item{ID: "after-dead-with-effects"}, tasks.After(p.Job.ID)))
	require.NoError(t, err)
	require.Equal(t, idempotency.StatusPending, late.Job.Status, "waits for a parent whose effects are in")

	_, err = e.client.Inspector().Discard(ctx, p.Job.ID, "ops", "the labels were printed by hand")
	require.NoError(t, err)
	j, err := e.store.Get(ctx, c.Job.ID)
	require.NoError(t, err)
	require.Equal(t, idempotency.StatusWaiting, j.Status, "cancelled by a parent whose effects are in: %s", j.ResolutionNote)
	d, err := e.client.Inspector().Dependencies(ctx, c.Job.ID)
	require.NoError(t, err)
	require.Len(t, d.Waits(), 1)
	require.Equal(t, q.Job.ID, d.Waits()[0].ID, "it waits for q alone")

	close(open)
	testworker.WaitStatus(t, e.store, c.Job.ID, idempotency.StatusSucceeded, 20*time.Second)
	testworker.WaitStatus(t, e.store, late.Job.ID, idempotency.StatusSucceeded, 20*time.Second)
	require.Equal(t, 1, e.effects(t, c.Job.ID))
	require.Equal(t, 1, e.effects(t, late.Job.ID))
}
