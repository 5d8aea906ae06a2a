package executor_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/testenv"
	"github.com/keeljobs/keel/server"
	"github.com/keeljobs/keel/tasks"
)

var (
	reporting = tasks.Define[order]("test:reporting", tasks.MaxRetry(0), tasks.Key(func(o order) string { return o.OrderID }))
	// hungReporter's handler outlives its timeout.
	hungReporter = tasks.Define[order]("test:hung_reporter", tasks.MaxRetry(0), tasks.Timeout(time.Second),
		tasks.Key(func(o order) string { return o.OrderID }))
	resulting = tasks.Define[order]("test:resulting", tasks.MaxRetry(0), tasks.Key(func(o order) string { return o.OrderID }))
)

// progressOf reads job id's progress as the operator API shows it.
func (b *bundle) progressOf(t *testing.T, id string) (idempotency.JobProgress, bool) {
	t.Helper()
	p, ok, err := b.client.Inspector().Progress(context.Background(), id)
	require.NoError(t, err)
	return p, ok
}

// A running job's progress shows while it runs; reports that come within
// the interval of the last write are coalesced, the latest written when
// the interval is up; and the progress stays once the job succeeded.
func TestProgressShowsWhileTheJobRuns(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	next := make(chan struct{})
	mux := tasks.NewMux()
	tasks.Handle(mux, reporting, func(ctx context.Context, o order) error {
		if err := idempotency.Progress(ctx, 1, 100, "started"); err != nil {
			return err
		}
		<-next
		for i := int64(2); i <= 100; i++ {
			if err := idempotency.Progress(ctx, i, 100, "copying"); err != nil {
				return err
			}
		}
		<-next
		return nil
	})
	srv := b.startWorker(t, mux, nil)
	res, err := b.client.Enqueue(ctx, reporting.New(order{OrderID: "p1"}))
	require.NoError(t, err)

	var p idempotency.JobProgress
	testenv.Eventually(t, 20*time.Second, func() bool {
		var ok bool
		p, ok = b.progressOf(t, res.Job.ID)
		return ok
	}, "the first report never showed")
	require.Equal(t, idempotency.JobProgress{Run: 1, Done: 1, Total: 100, Note: "started", UpdatedAt: p.UpdatedAt}, p)
	require.Equal(t, idempotency.StatusRunning, b.waitStatus(t, res.Job.ID, idempotency.StatusRunning, time.Second).Status)

	next <- struct{}{}
	testenv.Eventually(t, 20*time.Second, func() bool {
		p, _ = b.progressOf(t, res.Job.ID)
		return p.Done == 100
	}, "the latest report was never written (last: %+v)", &p)
	require.Equal(t, "copying", p.Note)
	// 100 reports: the first written at once, the 99 that came within its
	// interval as one. (A host that took a second over the loop could
	// write one more.)
	require.LessOrEqual(t, srv.GuardStats().ProgressWrites, uint64(3))

	next <- struct{}{}
	b.waitStatus(t, res.Job.ID, idempotency.StatusSucceeded, 20*time.Second)
	p, ok := b.progressOf(t, res.Job.ID)
	require.True(t, ok, "the progress stays with the finished job")
	require.EqualValues(t, 100, p.Done)
}

// However often a handler reports, a run writes at most once an
// interval; the report not yet written when it returns is dropped.
func TestProgressWritesAreBoundedPerInterval(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	reported := make(chan struct{})
	finish := make(chan struct{})
	mux := tasks.NewMux()
	tasks.Handle(mux, reporting, func(ctx context.Context, o order) error {
		for i := int64(1); i <= 5000; i++ {
			if err := idempotency.Progress(ctx, i, 5000, ""); err != nil {
				return err
			}
		}
		close(reported)
		<-finish
		return nil
	})
	// An interval no test outlives: every write is counted, none timed.
	srv := b.startWorker(t, mux, func(c *server.Config) { c.Guard.ProgressInterval = time.Hour })
	res, err := b.client.Enqueue(ctx, reporting.New(order{OrderID: "p2"}))
	require.NoError(t, err)
	<-reported
	require.EqualValues(t, 1, srv.GuardStats().ProgressWrites, "5,000 reports within one interval are one write")
	p, ok := b.progressOf(t, res.Job.ID)
	require.True(t, ok)
	require.EqualValues(t, 1, p.Done, "the first report is written at once")
	close(finish)
	b.waitStatus(t, res.Job.ID, idempotency.StatusSucceeded, 20*time.Second)
	require.EqualValues(t, 1, srv.GuardStats().ProgressWrites, "the last report, not yet due, is dropped at the end")
	p, _ = b.progressOf(t, res.Job.ID)
	require.EqualValues(t, 1, p.Done)
}

// A run keel gave up (its handler outlived its timeout) cannot report any
// more, nor can a goroutine its handler left behind once it returned, nor
// a handler after its completing InTx.
func TestProgressOfAnEndedRunIsRefused(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	release := make(chan struct{})
	var mu sync.Mutex
	errs := map[string]error{}
	note := func(name string, err error) {
		mu.Lock()
		errs[name] = err
		mu.Unlock()
	}
	var left sync.WaitGroup
	mux := tasks.NewMux()
	tasks.Handle(mux, hungReporter, func(ctx context.Context, o order) error {
		if err := idempotency.Progress(ctx, 1, 2, "before the timeout"); err != nil {
			return err
		}
		<-release // ignores ctx
		note("given up", idempotency.Progress(ctx, 2, 2, "late"))
		return nil
	})
	tasks.Handle(mux, reporting, func(ctx context.Context, o order) error {
		if o.OrderID == "done" {
			left.Add(1)
			go func() {
				defer left.Done()
				<-release
				note("returned", idempotency.Progress(ctx, 2, 2, "after the return"))
			}()
			return idempotency.Progress(ctx, 1, 2, "")
		}
		if err := idempotency.InTx(ctx, func(pgx.Tx) error { return nil }); err != nil {
			return err
		}
		note("completed", idempotency.Progress(ctx, 2, 2, "after the completion"))
		return nil
	})
	freed := false
	free := func() {
		if !freed {
			freed = true
			close(release)
			left.Wait()
		}
	}
	defer free()
	b.startWorker(t, mux, func(c *server.Config) { c.Guard.TimeoutGrace = 200 * time.Millisecond })
	hung, err := b.client.Enqueue(ctx, hungReporter.New(order{OrderID: "hung"}))
	require.NoError(t, err)
	done, err := b.client.Enqueue(ctx, reporting.New(order{OrderID: "done"}))
	require.NoError(t, err)
	completed, err := b.client.Enqueue(ctx, reporting.New(order{OrderID: "completed"}))
	require.NoError(t, err)
	require.Equal(t, "timeout", b.waitStatus(t, hung.Job.ID, idempotency.StatusDead, 30*time.Second).ErrorClass)
	b.waitStatus(t, done.Job.ID, idempotency.StatusSucceeded, 20*time.Second)
	b.waitStatus(t, completed.Job.ID, idempotency.StatusSucceeded, 20*time.Second)

	free()
	testenv.Eventually(t, 10*time.Second, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(errs) == 3
	}, "the late reports never came back")
	require.ErrorIs(t, errs["given up"], idempotency.ErrRunGivenUp)
	require.ErrorIs(t, errs["returned"], idempotency.ErrRunEnded)
	require.ErrorIs(t, errs["completed"], idempotency.ErrAlreadyCompleted)
	for _, id := range []string{hung.Job.ID, done.Job.ID} {
		p, ok := b.progressOf(t, id)
		require.True(t, ok)
		require.EqualValues(t, 1, p.Done, "job %s: a late report was written", id)
	}
	_, ok := b.progressOf(t, completed.Job.ID)
	require.False(t, ok)
}

// resultRow is what the ledger holds for job id, in one snapshot: its
// status and whether a result row exists.
func (b *bundle) resultRow(t *testing.T, id string) (idempotency.Status, bool) {
	t.Helper()
	var st idempotency.Status
	var has bool
	require.NoError(t, b.pool.QueryRow(context.Background(), `SELECT j.status, r.job_id IS NOT NULL FROM keel_jobs j
		LEFT JOIN keel_job_results r ON r.job_id = j.id WHERE j.id = $1`, id).Scan(&st, &has))
	return st, has
}

type receiptNo struct {
	Number int    `json:"number"`
	By     string `json:"by"`
}

// A result set before the completing InTx commits in its transaction: a
// rolled-back InTx leaves none, a committed one leaves it; a handler that
// fails after its completing InTx leaves none either.
func TestResultCommitsWithTheCompletingInTx(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	mux := tasks.NewMux()
	var rollbackRuns atomic.Int32
	tasks.Handle(mux, resulting, func(ctx context.Context, o order) error {
		run := 1
		if o.OrderID == "rollback" {
			run = int(rollbackRuns.Add(1))
		}
		if err := idempotency.SetResult(ctx, receiptNo{Number: run, By: "intx"}); err != nil {
			return err
		}
		err := idempotency.InTx(ctx, func(tx pgx.Tx) error {
			if run == 1 && o.OrderID == "rollback" {
				return errors.New("the effect failed")
			}
			return nil
		})
		if err != nil {
			return err
		}
		if o.OrderID == "after" {
			return errors.New("what came after the completion failed")
		}
		return nil
	})
	b.startWorker(t, mux, nil)
	rolled, err := b.client.Enqueue(ctx, resulting.New(order{OrderID: "rollback"}))
	require.NoError(t, err)
	after, err := b.client.Enqueue(ctx, resulting.New(order{OrderID: "after"}))
	require.NoError(t, err)

	b.waitStatus(t, rolled.Job.ID, idempotency.StatusDead, 20*time.Second)
	_, has := b.resultRow(t, rolled.Job.ID)
	require.False(t, has, "the rolled-back InTx stored a result")
	_, err = b.client.Result(ctx, rolled.Job.ID)
	require.ErrorIs(t, err, idempotency.ErrNoResult)
	require.ErrorContains(t, err, "is dead")

	_, err = b.client.Inspector().Replay(ctx, rolled.Job.ID, "test", "")
	require.NoError(t, err)
	b.waitStatus(t, rolled.Job.ID, idempotency.StatusSucceeded, 20*time.Second)
	got, err := tasks.ResultAs[receiptNo](b.client.Result(ctx, rolled.Job.ID))
	require.NoError(t, err)
	require.Equal(t, receiptNo{Number: 2, By: "intx"}, got, "the second run's result, committed with its InTx")
	byKey, err := b.client.ResultByKey(ctx, resulting.Name(), "rollback")
	require.NoError(t, err)
	require.JSONEq(t, `{"number": 2, "by": "intx"}`, string(byKey.JSON))

	j := b.waitStatus(t, after.Job.ID, idempotency.StatusDead, 20*time.Second)
	require.NotNil(t, j.EffectsCommittedAt)
	_, has = b.resultRow(t, after.Job.ID)
	require.False(t, has, "a job that failed after its completing InTx kept its result")
}

// Without a completing InTx, the result commits with the job's success in
// one statement: it exists exactly when the job is succeeded. A handler
// that sets one and fails leaves none; one too large is refused.
func TestResultWithoutInTxAppearsWithSuccess(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	finish := make(chan struct{})
	mux := tasks.NewMux()
	var tooLarge error
	tasks.Handle(mux, resulting, func(ctx context.Context, o order) error {
		switch o.OrderID {
		case "fails":
			if err := idempotency.SetResult(ctx, "half done"); err != nil {
				return err
			}
			return errors.New("then it failed")
		case "large":
			tooLarge = idempotency.SetResult(ctx, strings.Repeat("x", idempotency.MaxResultBytes))
			return nil
		case "parent":
			return idempotency.SetResult(ctx, receiptNo{Number: 7, By: "parent"})
		}
		if parentID, ok := strings.CutPrefix(o.OrderID, "child:"); ok {
			parent, err := tasks.ResultAs[receiptNo](idempotency.ResultOf(ctx, parentID))
			if err != nil {
				return err
			}
			return idempotency.SetResult(ctx, receiptNo{Number: parent.Number + 1, By: "child"})
		}
		if err := idempotency.SetResult(ctx, receiptNo{Number: 1, By: "return"}); err != nil {
			return err
		}
		<-finish
		return nil
	})
	b.startWorker(t, mux, nil)
	res, err := b.client.Enqueue(ctx, resulting.New(order{OrderID: "plain"}))
	require.NoError(t, err)
	id := res.Job.ID

	// Watch the row while the job runs and completes: never a result
	// without success, never success without the result.
	stop := make(chan struct{})
	watched := make(chan error, 1)
	go func() {
		for {
			var st idempotency.Status
			var has bool
			err := b.pool.QueryRow(ctx, `SELECT j.status, r.job_id IS NOT NULL FROM keel_jobs j
				LEFT JOIN keel_job_results r ON r.job_id = j.id WHERE j.id = $1`, id).Scan(&st, &has)
			if err != nil {
				watched <- err
				return
			}
			if (st == idempotency.StatusSucceeded) != has {
				watched <- fmt.Errorf("status %s, result row: %v", st, has)
				return
			}
			select {
			case <-stop:
				watched <- nil
				return
			default:
			}
		}
	}()
	b.waitStatus(t, id, idempotency.StatusRunning, 20*time.Second)
	_, err = b.client.Result(ctx, id)
	require.ErrorIs(t, err, idempotency.ErrNoResult)
	require.ErrorContains(t, err, "is running")
	close(finish)
	b.waitStatus(t, id, idempotency.StatusSucceeded, 20*time.Second)
	close(stop)
	require.NoError(t, <-watched)
	got, err := tasks.ResultAs[receiptNo](b.client.Result(ctx, id))
	require.NoError(t, err)
	require.Equal(t, receiptNo{Number: 1, By: "return"}, got)
	viaInspect, err := b.client.Inspector().Result(ctx, id)
	require.NoError(t, err)
	require.JSONEq(t, `{"number": 1, "by": "return"}`, string(viaInspect.JSON))
	_, err = b.client.Result(ctx, "01936f3e-8c1a-7b2e-9f00-1a2b3c4d5e6f")
	require.ErrorIs(t, err, idempotency.ErrNotFound)
	_, err = b.client.ResultByKey(ctx, resulting.Name(), "nobody")
	require.ErrorIs(t, err, idempotency.ErrNotFound)

	failed, err := b.client.Enqueue(ctx, resulting.New(order{OrderID: "fails"}))
	require.NoError(t, err)
	large, err := b.client.Enqueue(ctx, resulting.New(order{OrderID: "large"}))
	require.NoError(t, err)
	b.waitStatus(t, failed.Job.ID, idempotency.StatusDead, 20*time.Second)
	_, has := b.resultRow(t, failed.Job.ID)
	require.False(t, has, "a failed run left its result")
	b.waitStatus(t, large.Job.ID, idempotency.StatusSucceeded, 20*time.Second)
	require.ErrorIs(t, tooLarge, idempotency.ErrResultTooLarge)
	_, err = b.client.Result(ctx, large.Job.ID)
	require.ErrorIs(t, err, idempotency.ErrNoResult)
	require.ErrorContains(t, err, "succeeded without storing one")

	// A handler reads another job's result by its id.
	parent, err := b.client.Enqueue(ctx, resulting.New(order{OrderID: "parent"}))
	require.NoError(t, err)
	b.waitStatus(t, parent.Job.ID, idempotency.StatusSucceeded, 20*time.Second)
	child, err := b.client.Enqueue(ctx, resulting.New(order{OrderID: "child:" + parent.Job.ID}))
	require.NoError(t, err)
	b.waitStatus(t, child.Job.ID, idempotency.StatusSucceeded, 20*time.Second)
	got, err = tasks.ResultAs[receiptNo](b.client.Result(ctx, child.Job.ID))
	require.NoError(t, err)
	require.Equal(t, receiptNo{Number: 8, By: "child"}, got)
}

// Batch members that store a result without an InTx are completed with it
// outside the shared round: their batch counts them, and its callbacks run
// once, as for any other member.
func TestBatchMembersWithResults(t *testing.T) {
	b := setup(t)
	batchTables(t, b)
	const n = 12
	members := make([]member, n)
	for i := range members {
		members[i] = member{Key: fmt.Sprintf("res-%02d", i), Mode: []string{"result", "plain", "noop"}[i%3]}
	}
	batch := b.newBatch(t, "results", members...)
	b.startWorker(t, batchMux(b.pool), nil)
	runs := b.waitCallbackRuns(t, batch.ID, 2, 30*time.Second)
	want := tasks.BatchCounts{Total: n, Succeeded: n}
	require.Equal(t, []callbackRun{{1, tasks.BatchComplete, want}, {1, tasks.BatchSuccess, want}}, runs)
	for _, m := range members {
		r, err := b.client.ResultByKey(context.Background(), batchMember.Name(), m.Key)
		if m.Mode != "result" {
			require.ErrorIs(t, err, idempotency.ErrNoResult, m.Key)
			continue
		}
		require.NoError(t, err, m.Key)
		require.JSONEq(t, `"`+m.Key+`"`, string(r.JSON))
	}
}
