package inspect_test

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/inspect"
	"github.com/keeljobs/keel/internal/testenv"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		goleak.IgnoreTopFunction("github.com/jackc/pgx/v5/pgxpool.(*Pool).backgroundHealthCheck"),
		goleak.IgnoreTopFunction("internal/poll.runtime_pollWait"),
	)
}

type bundle struct {
	pool *pgxpool.Pool
	ops  *inspect.Inspector
}

var setupMu sync.Mutex

func setup(t *testing.T) *bundle {
	t.Helper()
	setupMu.Lock()
	t.Cleanup(setupMu.Unlock)
	b := &bundle{pool: testenv.Pool(t, "keel_test_inspect")}
	ops, err := inspect.New(inspect.Config{Pool: b.pool, Redis: testenv.Redis(t, testenv.DBInspect), Poll: 20 * time.Millisecond})
	require.NoError(t, err)
	t.Cleanup(func() { ops.Close() })
	b.ops = ops
	return b
}

func (b *bundle) count(t *testing.T, sql string, args ...any) int {
	t.Helper()
	var n int
	require.NoError(t, b.pool.QueryRow(context.Background(), sql, args...).Scan(&n))
	return n
}

func (b *bundle) status(t *testing.T, id string) idempotency.Status {
	t.Helper()
	j, err := b.ops.Get(context.Background(), id)
	require.NoError(t, err)
	return j.Status
}

// shapes are jobs in every state an operator action tells apart.
var shapes = []string{"dead", "dead-verifiable-step", "dead-in-doubt", "dead-effects", "dead-superseded",
	"discarded", "cancelled", "pending", "running", "failed", "succeeded"}

// put writes a job of kind in shape straight into the ledger, and returns
// its id.
func (b *bundle) put(t *testing.T, kind, shape string) string {
	t.Helper()
	ctx := context.Background()
	id := uuid.Must(uuid.NewV7()).String()
	status := shape
	if len(shape) > 4 && shape[:4] == "dead" {
		status = "dead"
	}
	key := shape + "-" + id
	if shape == "dead-superseded" {
		key += "#" + id
	}
	_, err := b.pool.Exec(ctx, `INSERT INTO keel_jobs (id, kind, business_key, queue, payload, status, max_retry, error_class,
		finished_at, superseded_at, effects_committed_at, resolved_by, resolution_note, lease_holder, lease_until)
		VALUES ($1, $2, $3, 'default', '{}', $4, 3, CASE WHEN $4 IN ('dead', 'failed') THEN 'permanent' END,
		CASE WHEN $4 IN ('dead', 'succeeded', 'discarded', 'cancelled') THEN now() END,
		CASE WHEN $5 = 'dead-superseded' THEN now() END, CASE WHEN $5 = 'dead-effects' THEN now() END,
		CASE WHEN $4 IN ('discarded', 'cancelled') THEN 'earlier' END, CASE WHEN $4 IN ('discarded', 'cancelled') THEN 'before' END,
		CASE WHEN $4 = 'running' THEN 'w1' END, CASE WHEN $4 = 'running' THEN now() + interval '1 minute' END)`,
		id, kind, key, status, shape)
	require.NoError(t, err)
	switch shape {
	case "dead-in-doubt", "dead-verifiable-step":
		_, err = b.pool.Exec(ctx, `INSERT INTO keel_steps (job_id, name, status, verifiable) VALUES ($1, 'charge', 'started', $2)`,
			id, shape == "dead-verifiable-step")
		require.NoError(t, err)
	}
	return id
}

// verdict sorts what an action said of a job: done, unchanged, or the
// sentinel error it was refused with.
func verdict(err error, unchanged bool) string {
	if err == nil && unchanged {
		return "unchanged"
	} else if err == nil {
		return "done"
	}
	for _, e := range []error{inspect.ErrNotFound, inspect.ErrNotDead, inspect.ErrStepsInDoubt, inspect.ErrEffectsCommitted,
		inspect.ErrNotCancellable, inspect.ErrTaskActive} {
		if errors.Is(err, e) {
			return e.Error()
		}
	}
	return "other: " + err.Error()
}

// single does a to job id, as one action, and says what it made of it.
func single(ctx context.Context, ops *inspect.Inspector, a inspect.Action, id string) string {
	switch a {
	case inspect.ActionReplay:
		res, err := ops.Replay(ctx, id, "alice", "single")
		return verdict(err, res.AlreadyReplayed)
	case inspect.ActionDiscard:
		res, err := ops.Discard(ctx, id, "alice", "single")
		return verdict(err, res.AlreadyDiscarded)
	}
	res, err := ops.Cancel(ctx, id, "alice", "single")
	return verdict(err, res.AlreadyCancelled)
}

// A bulk action refuses exactly the jobs the single action refuses, for
// the same reason, and so does the dry run: the rules live once.
func TestBulkRefusesWhatSingleRefuses(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	for _, a := range []inspect.Action{inspect.ActionReplay, inspect.ActionDiscard, inspect.ActionCancel} {
		t.Run(string(a), func(t *testing.T) {
			one, many := map[string]string{}, map[string]string{}
			for _, sh := range shapes {
				one[sh], many[sh] = b.put(t, "one:"+string(a), sh), b.put(t, "many:"+string(a), sh)
			}
			missing := uuid.Must(uuid.NewV7()).String()
			one["missing"], many["missing"] = missing, missing

			ids := make([]string, 0, len(many))
			for _, id := range many {
				ids = append(ids, id)
			}
			checked, err := b.ops.Check(ctx, a, ids)
			require.NoError(t, err)
			dry := map[string]string{}
			for _, o := range checked {
				dry[o.ID] = verdict(o.Err, o.Unchanged != "")
			}
			res, err := b.ops.Bulk(ctx, a, ids, "bob", "bulk", nil)
			require.NoError(t, err)

			for sh, id := range one {
				want := single(ctx, b.ops, a, id)
				bid := many[sh]
				got := "done"
				if why, ok := res.Failed[bid]; ok {
					require.NotEmpty(t, why)
					got = dry[bid] // the sentinel, as the check named it
					require.NotEqual(t, "done", got, "%s: the bulk action refused what the check let pass: %s", sh, why)
				} else if _, ok := res.Unchanged[bid]; ok {
					got = "unchanged"
				}
				require.Equal(t, want, got, "%s: bulk and single differ", sh)
				require.Equal(t, want, dry[bid], "%s: the dry run and the action differ", sh)
				if sh != "missing" {
					require.Equal(t, b.status(t, id), b.status(t, bid), "%s: left in different states", sh)
				}
			}
			require.Equal(t, res.Done, b.count(t, `SELECT count(*) FROM keel_audit WHERE actor = 'bob' AND action = $1`, string(a)),
				"one audit row per job changed")
			require.Equal(t, res.Done, b.count(t, `SELECT count(*) FROM keel_audit WHERE actor = 'alice' AND action = $1`, string(a)))
		})
	}
}

// The verdicts the tests above compare are the ones the package's doc
// promises.
func TestWhatEachActionRefuses(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	want := map[inspect.Action]map[string]string{
		inspect.ActionReplay: {"dead": "done", "dead-verifiable-step": "done", "dead-in-doubt": inspect.ErrStepsInDoubt.Error(),
			"dead-effects": inspect.ErrEffectsCommitted.Error(), "dead-superseded": inspect.ErrNotDead.Error(),
			"discarded": inspect.ErrNotDead.Error(), "cancelled": inspect.ErrNotDead.Error(), "pending": "unchanged",
			"running": "unchanged", "failed": "unchanged", "succeeded": "unchanged"},
		inspect.ActionDiscard: {"dead": "done", "dead-verifiable-step": "done", "dead-in-doubt": "done", "dead-effects": "done",
			"dead-superseded": "done", "discarded": "unchanged", "cancelled": inspect.ErrNotDead.Error(),
			"pending": inspect.ErrNotDead.Error(), "running": inspect.ErrNotDead.Error(), "failed": inspect.ErrNotDead.Error(),
			"succeeded": inspect.ErrNotDead.Error()},
		inspect.ActionCancel: {"dead": inspect.ErrNotCancellable.Error(), "dead-verifiable-step": inspect.ErrNotCancellable.Error(),
			"dead-in-doubt": inspect.ErrNotCancellable.Error(), "dead-effects": inspect.ErrNotCancellable.Error(),
			"dead-superseded": inspect.ErrNotCancellable.Error(), "discarded": inspect.ErrNotCancellable.Error(),
			"cancelled": "unchanged", "pending": "done", "running": "done", "failed": "done",
			"succeeded": inspect.ErrNotCancellable.Error()},
	}
	for a, byShape := range want {
		for _, sh := range shapes {
			id := b.put(t, "rules:"+string(a), sh)
			require.Equal(t, byShape[sh], single(ctx, b.ops, a, id), "%s of a job %s", a, sh)
		}
	}
	_, err := b.ops.Replay(ctx, b.put(t, "rules", "dead"), " ", "")
	require.ErrorIs(t, err, inspect.ErrActorRequired)
	_, err = b.ops.Discard(ctx, b.put(t, "rules", "dead"), "alice", " ")
	require.ErrorIs(t, err, inspect.ErrNoteRequired)
	_, err = b.ops.Cancel(ctx, b.put(t, "rules", "pending"), "", "")
	require.ErrorIs(t, err, inspect.ErrActorRequired)
	_, err = b.ops.Replay(ctx, uuid.Must(uuid.NewV7()).String(), "alice", "")
	require.ErrorIs(t, err, inspect.ErrNotFound)
	// A step in doubt is named.
	_, err = b.ops.Replay(ctx, b.put(t, "rules", "dead-in-doubt"), "alice", "")
	require.ErrorContains(t, err, "charge")
}

// What the dry run counts is what the action then does.
func TestDryRunCountsWhatTheActionDoes(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	for _, a := range []inspect.Action{inspect.ActionReplay, inspect.ActionDiscard, inspect.ActionCancel} {
		kind := "dry:" + string(a)
		for _, sh := range shapes {
			for range 3 {
				b.put(t, kind, sh)
			}
		}
		f := inspect.Filter{Kind: kind}
		dry, err := b.ops.DryRunMatching(ctx, a, f)
		require.NoError(t, err)
		require.Positive(t, dry.Would)
		var res inspect.BulkResult
		switch a {
		case inspect.ActionReplay:
			_, err = b.ops.ReplayMatching(ctx, f, dry.Matched+1, "carol", "dry")
			require.ErrorIs(t, err, inspect.ErrCountChanged)
			res, err = b.ops.ReplayMatching(ctx, f, dry.Matched, "carol", "dry")
		case inspect.ActionDiscard:
			res, err = b.ops.DiscardMatching(ctx, f, dry.Matched, "carol", "dry")
		default:
			res, err = b.ops.CancelMatching(ctx, f, dry.Matched, "carol", "dry")
		}
		require.NoError(t, err)
		require.Equal(t, dry.Matched, res.Matched, a)
		require.Equal(t, dry.Would, res.Done, a)
		require.Equal(t, dry.Unchanged, len(res.Unchanged), a)
		require.Equal(t, dry.RefusedTotal(), len(res.Failed), a)
		if a == inspect.ActionReplay {
			require.Equal(t, map[string]int{"steps in doubt": 3, "effects committed": 3, "superseded": 3}, dry.Refused)
		}
		after, err := b.ops.DryRunMatching(ctx, a, f)
		require.NoError(t, err)
		require.Zero(t, after.Would, "%s: nothing is left to do", a)
	}
}

// Two bulk actions on the same jobs at once do each job once: the audit
// log has one row per job.
func TestRacingBulkActionsDoEachJobOnce(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	for _, a := range []inspect.Action{inspect.ActionReplay, inspect.ActionCancel} {
		shape := "dead"
		if a == inspect.ActionCancel {
			shape = "running"
		}
		var ids []string
		for range 1200 { // pages of both, overlapping
			ids = append(ids, b.put(t, "race:"+string(a), shape))
		}
		rev := slices.Clone(ids)
		slices.Reverse(rev)
		var wg sync.WaitGroup
		res := make([]inspect.BulkResult, 2)
		errs := make([]error, 2)
		for i, set := range [][]string{ids, rev} {
			wg.Go(func() {
				res[i], errs[i] = b.ops.Bulk(ctx, a, set, fmt.Sprintf("racer-%d", i), "race", nil)
			})
		}
		wg.Wait()
		require.NoError(t, errs[0])
		require.NoError(t, errs[1])
		require.Equal(t, len(ids), res[0].Done+res[1].Done, a)
		require.Equal(t, len(ids), len(res[0].Unchanged)+len(res[1].Unchanged), a)
		require.Empty(t, res[0].Failed)
		require.Empty(t, res[1].Failed)
		require.Equal(t, len(ids), b.count(t, `SELECT count(*) FROM keel_audit WHERE action = $1 AND note = 'race'`, string(a)))
		require.Zero(t, b.count(t, `SELECT count(*) FROM (SELECT job_id FROM keel_audit WHERE action = $1 AND note = 'race'
			GROUP BY job_id HAVING count(*) > 1) twice`, string(a)))
	}
}

func TestCountsAndWaitDone(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	for _, sh := range []string{"pending", "pending", "dead", "succeeded"} {
		b.put(t, "count:a", sh)
	}
	b.put(t, "count:b", "failed")
	cs, err := b.ops.Counts(ctx, "count:a", "count:b", "count:none")
	require.NoError(t, err)
	require.Equal(t, []inspect.Count{
		{Kind: "count:a", Status: idempotency.StatusDead, N: 1},
		{Kind: "count:a", Status: idempotency.StatusPending, N: 2},
		{Kind: "count:a", Status: idempotency.StatusSucceeded, N: 1},
		{Kind: "count:b", Status: idempotency.StatusFailed, N: 1},
	}, cs)
	all, err := b.ops.Counts(ctx)
	require.NoError(t, err)
	require.Len(t, all, 4)

	id := b.put(t, "wait", "pending")
	short, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	defer cancel()
	_, err = b.ops.WaitDone(short, id)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	done := make(chan idempotency.Job, 1)
	go func() {
		j, err := b.ops.WaitDone(ctx, id)
		if err == nil {
			done <- j
		}
		close(done)
	}()
	res, err := b.ops.Cancel(ctx, id, "dave", "no longer wanted")
	require.NoError(t, err)
	require.False(t, res.WasRunning)
	select {
	case j := <-done:
		require.Equal(t, idempotency.StatusCancelled, j.Status)
	case <-time.After(5 * time.Second):
		t.Fatal("WaitDone did not see the job end")
	}
	_, err = b.ops.WaitDone(ctx, uuid.Must(uuid.NewV7()).String())
	require.ErrorIs(t, err, inspect.ErrNotFound)
}

// ResolveStep settles a step in doubt, audited, and then a replay passes.
func TestResolveStepThenReplay(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	for _, happened := range []bool{true, false} {
		id := b.put(t, "resolve", "dead-in-doubt")
		_, err := b.ops.Replay(ctx, id, "erin", "")
		require.ErrorIs(t, err, inspect.ErrStepsInDoubt)
		require.ErrorIs(t, b.ops.ResolveStep(ctx, id, "charge", happened, "", "x"), inspect.ErrActorRequired)
		require.ErrorIs(t, b.ops.ResolveStep(ctx, id, "sms", happened, "erin", "x"), inspect.ErrNotFound)
		require.NoError(t, b.ops.ResolveStep(ctx, id, "charge", happened, "erin", "checked"))
		require.NoError(t, b.ops.ResolveStep(ctx, id, "charge", happened, "erin", "checked"), "said twice")
		_, err = b.ops.Replay(ctx, id, "erin", "resolved")
		require.NoError(t, err)
		es, err := b.ops.Audit(ctx, id)
		require.NoError(t, err)
		var actions []string
		for _, e := range es {
			actions = append(actions, e.Action)
		}
		want := "step-not-happened:charge"
		if happened {
			want = "step-happened:charge"
		}
		require.Equal(t, []string{want, "replay"}, actions)
	}
	pending := b.put(t, "resolve", "pending")
	require.ErrorIs(t, b.ops.ResolveStep(ctx, pending, "charge", true, "erin", ""), inspect.ErrNotDead)
}

// "It did not happen" is refused while the step's call may still be in
// flight (its worker renews the mark while the call has not returned): a
// replay would make the call a second time beside it. "It happened" is a
// person's word and stands.
func TestResolveStepRefusesNotHappenedWhileTheCallIsInFlight(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	id := b.put(t, "resolve", "dead-in-doubt")
	_, err := b.pool.Exec(ctx, `UPDATE keel_steps SET call_until = now() + interval '1 minute', call_holder = 'w1' WHERE job_id = $1`, id)
	require.NoError(t, err)
	err = b.ops.ResolveStep(ctx, id, "charge", false, "erin", "nothing at the bank")
	require.ErrorIs(t, err, inspect.ErrCallInFlight)
	require.Contains(t, err.Error(), "in flight")
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM keel_steps WHERE job_id = $1 AND status = 'started'`, id), "forgotten")
	require.Zero(t, b.count(t, `SELECT count(*) FROM keel_audit WHERE job_id = $1`, id))

	// The call returned, or its worker died (the mark ran out).
	_, err = b.pool.Exec(ctx, `UPDATE keel_steps SET call_until = now() - interval '1 second' WHERE job_id = $1`, id)
	require.NoError(t, err)
	require.NoError(t, b.ops.ResolveStep(ctx, id, "charge", false, "erin", "nothing at the bank"))

	other := b.put(t, "resolve", "dead-in-doubt")
	_, err = b.pool.Exec(ctx, `UPDATE keel_steps SET call_until = now() + interval '1 minute', call_holder = 'w1' WHERE job_id = $1`, other)
	require.NoError(t, err)
	require.NoError(t, b.ops.ResolveStep(ctx, other, "charge", true, "erin", "the bank has it"))
}

func TestConfigValidate(t *testing.T) {
	require.Error(t, inspect.Config{}.Validate())
	_, err := inspect.New(inspect.Config{})
	require.Error(t, err)
}

// The audit log is written and read only by the ledger's operator
// statements, which this package alone calls: the CLI, the dashboard and
// asynqmon have no way of their own to act on a job.
func TestTheAuditLogHasOneWriter(t *testing.T) {
	root := filepath.Join("..")
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && strings.HasPrefix(d.Name(), ".") && path != root {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return nil
		}
		src, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, path)
		if strings.Contains(string(src), "keel_audit") && filepath.Dir(rel) != filepath.Join("internal", "ledger") &&
			!strings.HasPrefix(rel, "migrate"+string(filepath.Separator)) {
			t.Errorf("%s names keel_audit: the audit log is the operator API's (inspect, internal/ledger)", rel)
		}
		if strings.Contains(string(src), `"github.com/keeljobs/keel/internal/ledger"`) {
			for _, fn := range []string{"ledger.Act(", "ledger.Audit(", "ledger.SettleStep("} {
				if strings.Contains(string(src), fn) && filepath.Dir(rel) != "inspect" {
					t.Errorf("%s calls %s: operator actions go through inspect", rel, fn)
				}
			}
		}
		return nil
	})
	require.NoError(t, err)
}
