package outbox_test

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/jobstore"
	"github.com/keeljobs/keel/internal/ledger"
	"github.com/keeljobs/keel/outbox"
)

const day = 24 * time.Hour

// finished inserts a job of kind with key, ended in status at finished.
func (b *bundle) finished(t *testing.T, kind, key, status string, at time.Time) string {
	t.Helper()
	ctx := context.Background()
	j, _, err := jobstore.NewStore(b.pool).Insert(ctx, b.pool, jobstore.NewJob{Kind: kind, BusinessKey: key, Queue: "default",
		Payload: []byte(`{}`), MaxRetry: 1})
	require.NoError(t, err)
	_, err = b.pool.Exec(ctx, `UPDATE keel_jobs SET status = $2, finished_at = $3, published_at = NULL WHERE id = $1`, j.ID, status, at)
	require.NoError(t, err)
	return j.ID
}

func (b *bundle) keys(t *testing.T) []string {
	t.Helper()
	rows, err := b.pool.Query(context.Background(), `SELECT business_key FROM keel_jobs ORDER BY business_key`)
	require.NoError(t, err)
	keys, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	return keys
}

// setPolicy records a person's policy as set an hour ago: before the
// moved clock of any test here starts.
func setPolicy(t *testing.T, b *bundle, p ledger.Policy) {
	t.Helper()
	require.NoError(t, ledger.SetRetention(context.Background(), b.pool, p, "ops", "sized", ledger.At(time.Now().Add(-time.Hour))))
}

// A kind's own retention prunes its jobs at its age, and only its jobs:
// another kind keeps the reconciler's Retention, and a status the policy
// does not name keeps it too.
func TestPruneFollowsEachKindsRetention(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	t0 := time.Now()
	b.finished(t, "a", "a-ok-3d", "succeeded", t0.Add(-3*day))
	b.finished(t, "a", "a-ok-1d", "succeeded", t0.Add(-1*day))
	b.finished(t, "a", "a-discarded-3d", "discarded", t0.Add(-3*day))
	b.finished(t, "b", "b-ok-3d", "succeeded", t0.Add(-3*day))
	b.finished(t, "c", "c-ok-20d", "succeeded", t0.Add(-20*day))
	setPolicy(t, b, ledger.Policy{Kind: "a", Status: "succeeded", Keep: 2 * day})
	setPolicy(t, b, ledger.Policy{Kind: "c", Status: "succeeded", Keep: 60 * day})

	r := newReconciler(t, outbox.ReconcilerConfig{Pool: b.pool, Redis: b.opt, Retention: 10 * day, PruneBatch: 1})
	defer r.Close()
	n, err := outbox.PruneAt(ctx, r, t0)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	require.Equal(t, []string{"a-discarded-3d", "a-ok-1d", "b-ok-3d", "c-ok-20d"}, b.keys(t))

	// Two days on: a's job of yesterday is past its 2 days; b's and the
	// discarded one are within the default 10 days.
	n, err = outbox.PruneAt(ctx, r, t0.Add(2*day))
	require.NoError(t, err)
	require.Equal(t, 1, n)
	require.Equal(t, []string{"a-discarded-3d", "b-ok-3d", "c-ok-20d"}, b.keys(t))

	// Thirty days on the default takes b's and the discarded one; c keeps
	// its own 60 days.
	_, err = outbox.PruneAt(ctx, r, t0.Add(30*day))
	require.NoError(t, err)
	require.Equal(t, []string{"c-ok-20d"}, b.keys(t))
	require.Equal(t, map[outbox.KindStatus]uint64{{Kind: "a", Status: "succeeded"}: 2, {Kind: "a", Status: "discarded"}: 1,
		{Kind: "b", Status: "succeeded"}: 1}, r.PrunedByKind())
}

// A person's policy wins over the one a kind declares in code; removing
// the person's brings the code's back.
func TestPersonsRetentionWinsOverCode(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	t0 := time.Now()
	b.finished(t, "a", "a-ok-5d", "succeeded", t0.Add(-5*day))
	require.NoError(t, ledger.DeclareRetention(ctx, b.pool, "a", []ledger.Policy{{Status: "succeeded", Keep: 2 * day}}, "worker"))
	setPolicy(t, b, ledger.Policy{Kind: "a", Status: "succeeded", Keep: 7 * day})
	r := newReconciler(t, outbox.ReconcilerConfig{Pool: b.pool, Redis: b.opt, Retention: 30 * day})
	defer r.Close()
	n, err := outbox.PruneAt(ctx, r, t0)
	require.NoError(t, err)
	require.Zero(t, n, "the person's 7 days hold over the code's 2")
	_, err = ledger.UnsetRetention(ctx, b.pool, "a", "succeeded", "ops", "back to the code's", nil)
	require.NoError(t, err)
	n, err = outbox.PruneAt(ctx, r, t0)
	require.NoError(t, err)
	require.Equal(t, 1, n, "the code's 2 days")
}

// Dead letters are kept for ever unless their kind bounds them, and a
// succeeded job's retention says nothing about them.
func TestDeadLettersKeptUnlessBounded(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	t0 := time.Now()
	dead := b.finished(t, "a", "a-dead-400d", "dead", t0.Add(-400*day))
	b.finished(t, "a", "a-ok-400d", "succeeded", t0.Add(-400*day))
	seen(t, b, t0.Add(-399*day), dead)
	setPolicy(t, b, ledger.Policy{Kind: "a", Status: "succeeded", Keep: 2 * day})
	r := newReconciler(t, outbox.ReconcilerConfig{Pool: b.pool, Redis: b.opt})
	defer r.Close()
	_, err := outbox.PruneAt(ctx, r, t0)
	require.NoError(t, err)
	_, err = outbox.PruneAt(ctx, r, t0.Add(10*day))
	require.NoError(t, err)
	require.Equal(t, []string{"a-dead-400d"}, b.keys(t), "seen, 400 days old, and no bound on a's dead letters")
	require.Empty(t, r.DeadLettersToDrop())
}

func seen(t *testing.T, b *bundle, at time.Time, ids ...string) {
	t.Helper()
	n, err := ledger.MarkSeen(context.Background(), b.pool, ids, "ops", ledger.At(at))
	require.NoError(t, err)
	require.Equal(t, len(ids), n)
}

// The count bound drops the oldest seen dead letters only, down to the
// bound, never an unseen one (which counts toward it all the same), and
// only a notice period after the alert said so.
func TestDeadLetterCountBoundDropsOldestSeenAfterNotice(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	t0 := time.Now()
	ids := map[string]string{}
	for i, name := range []string{"d1-unseen", "d2-seen", "d3-unseen", "d4-seen", "d5-seen", "d6-seen"} {
		ids[name] = b.finished(t, "a", name, "dead", t0.Add(-time.Duration(10-i)*day))
	}
	b.finished(t, "b", "b-seen", "dead", t0.Add(-20*day))
	seen(t, b, t0.Add(-time.Hour), ids["d2-seen"], ids["d4-seen"], ids["d5-seen"], ids["d6-seen"])
	_, err := ledger.MarkSeen(ctx, b.pool, b.ids(t, "b-seen"), "ops", nil)
	require.NoError(t, err)
	// Six dead letters, three kept: three go, the oldest seen ones (d2, d4,
	// d5); the unseen d1 and d3 stay though older.
	setPolicy(t, b, ledger.Policy{Kind: "a", Status: "dead", MaxCount: 3})

	var log syncBuffer
	r := newReconciler(t, outbox.ReconcilerConfig{Pool: b.pool, Redis: b.opt, DeadDropNotice: day,
		Logger: slog.New(slog.NewTextHandler(&log, nil))})
	defer r.Close()
	n, err := outbox.PruneAt(ctx, r, t0)
	require.NoError(t, err)
	require.Zero(t, n, "nothing is dropped before its notice")
	require.Equal(t, map[string]int{"a": 3}, r.DeadLettersToDrop(), "the alert's gauge, before anything is dropped")
	require.Contains(t, log.String(), `msg="keel reconciler: seen dead letters are past their kind's bound and will be dropped" kind=a count=3`)
	require.NotContains(t, log.String(), "dropped seen dead letters")
	require.Len(t, b.keys(t), 7)

	_, err = outbox.PruneAt(ctx, r, t0.Add(day-time.Minute))
	require.NoError(t, err)
	require.Len(t, b.keys(t), 7, "within the notice")

	n, err = outbox.PruneAt(ctx, r, t0.Add(day+time.Minute))
	require.NoError(t, err)
	require.Equal(t, 3, n)
	require.Equal(t, []string{"b-seen", "d1-unseen", "d3-unseen", "d6-seen"}, b.keys(t))
	require.Empty(t, r.DeadLettersToDrop())
	require.Contains(t, log.String(), `msg="keel reconciler: dropped seen dead letters past their kind's bound" kind=a count=3`)
	require.Equal(t, map[outbox.KindStatus]uint64{{Kind: "a", Status: "dead"}: 3}, r.PrunedByKind())

	// Over the bound by unseen ones only: nothing more goes, ever.
	_, err = outbox.PruneAt(ctx, r, t0.Add(100*day))
	require.NoError(t, err)
	require.Equal(t, []string{"b-seen", "d1-unseen", "d3-unseen", "d6-seen"}, b.keys(t))
}

func (b *bundle) ids(t *testing.T, keys ...string) []string {
	t.Helper()
	rows, err := b.pool.Query(context.Background(), `SELECT id FROM keel_jobs WHERE business_key = ANY($1)`, keys)
	require.NoError(t, err)
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	return ids
}

// The age bound, and what "seen" means: shown after the job last died. A
// dead letter seen, replayed and dead again is unseen until shown again.
func TestDeadLetterAgeBoundNeedsSeenSinceDeath(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	t0 := time.Now()
	old := b.finished(t, "a", "old", "dead", t0.Add(-40*day))
	seen(t, b, t0.Add(-39*day), old)
	// Died again after it was seen: the sighting is of an earlier death.
	_, err := b.pool.Exec(ctx, `UPDATE keel_jobs SET finished_at = $2 WHERE id = $1`, old, t0.Add(-35*day))
	require.NoError(t, err)
	setPolicy(t, b, ledger.Policy{Kind: "a", Status: "dead", Keep: 30 * day})
	r := newReconciler(t, outbox.ReconcilerConfig{Pool: b.pool, Redis: b.opt, DeadDropNotice: day})
	defer r.Close()
	for _, at := range []time.Time{t0, t0.Add(2 * day)} {
		_, err = outbox.PruneAt(ctx, r, at)
		require.NoError(t, err)
	}
	require.Equal(t, []string{"old"}, b.keys(t), "not seen since it last died")
	require.Empty(t, r.DeadLettersToDrop())

	seen(t, b, t0.Add(2*day), old)
	_, err = outbox.PruneAt(ctx, r, t0.Add(2*day))
	require.NoError(t, err)
	require.Equal(t, map[string]int{"a": 1}, r.DeadLettersToDrop())
	n, err := outbox.PruneAt(ctx, r, t0.Add(3*day+time.Minute))
	require.NoError(t, err)
	require.Equal(t, 1, n)
	require.Empty(t, b.keys(t))
}

// A dead letter being replayed is not dropped: the replay holds the job
// locked from its judgement to its change, and the drop skips it, then
// finds it pending. Nor does its notice carry over to a later death.
func TestDeadLetterDropSkipsAReplay(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	t0 := time.Now()
	id := b.finished(t, "a", "replayed", "dead", t0.Add(-40*day))
	seen(t, b, t0.Add(-39*day), id)
	setPolicy(t, b, ledger.Policy{Kind: "a", Status: "dead", Keep: 30 * day})
	r := newReconciler(t, outbox.ReconcilerConfig{Pool: b.pool, Redis: b.opt, DeadDropNotice: day})
	defer r.Close()
	_, err := outbox.PruneAt(ctx, r, t0)
	require.NoError(t, err)
	require.Equal(t, map[string]int{"a": 1}, r.DeadLettersToDrop())

	// A replay, as inspect's does it: lock, judge, act, in one transaction.
	tx, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck
	require.NoError(t, ledger.LockJobs(ctx, tx, []string{id}))
	n, err := outbox.PruneAt(ctx, r, t0.Add(2*day))
	require.NoError(t, err, "the drop does not wait for the replay")
	require.Zero(t, n, "mid-replay")
	acted, err := ledger.Act(ctx, tx, ledger.Replay, []string{id}, "ops", "fixed", nil)
	require.NoError(t, err)
	require.Len(t, acted, 1)
	require.NoError(t, tx.Commit(ctx))

	n, err = outbox.PruneAt(ctx, r, t0.Add(3*day))
	require.NoError(t, err)
	require.Zero(t, n)
	j, err := jobstore.NewStore(b.pool).Get(ctx, id)
	require.NoError(t, err)
	require.Equal(t, idempotency.StatusPending, j.Status)

	// It dies again a day after its replay: unseen since, it stays past
	// the age bound; seen, it waits a notice of its own.
	died := t0.Add(3 * day)
	_, err = b.pool.Exec(ctx, `UPDATE keel_jobs SET status = 'dead', finished_at = $2 WHERE id = $1`, id, died)
	require.NoError(t, err)
	_, err = outbox.PruneAt(ctx, r, died.Add(31*day))
	require.NoError(t, err)
	require.Equal(t, []string{"replayed"}, b.keys(t))
	seen(t, b, died.Add(31*day), id)
	n, err = outbox.PruneAt(ctx, r, died.Add(31*day+time.Hour))
	require.NoError(t, err)
	require.Zero(t, n, "noticed now, dropped a day later")
	n, err = outbox.PruneAt(ctx, r, died.Add(32*day+2*time.Hour))
	require.NoError(t, err)
	require.Equal(t, 1, n)
}

// A kind's retention is its keys' dedupe window: once its job is pruned,
// the same key makes a new job, while another kind's key still dedupes.
func TestDedupeAfterPerKindPrune(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	t0 := time.Now()
	c := b.client(t, b.opt)
	first, err := c.Enqueue(ctx, work.New(item{ID: "k1"}))
	require.NoError(t, err)
	other := b.finished(t, "other", "k1", "succeeded", t0.Add(-3*day))
	_, err = b.pool.Exec(ctx, `UPDATE keel_jobs SET status = 'succeeded', finished_at = $2 WHERE id = $1`, first.Job.ID, t0.Add(-3*day))
	require.NoError(t, err)
	setPolicy(t, b, ledger.Policy{Kind: work.Name(), Status: "succeeded", Keep: 2 * day})

	again, err := c.Enqueue(ctx, work.New(item{ID: "k1"}))
	require.NoError(t, err)
	require.True(t, again.Existed, "kept: the key dedupes")
	r := newReconciler(t, outbox.ReconcilerConfig{Pool: b.pool, Redis: b.opt})
	defer r.Close()
	_, err = outbox.PruneAt(ctx, r, t0)
	require.NoError(t, err)
	again, err = c.Enqueue(ctx, work.New(item{ID: "k1"}))
	require.NoError(t, err)
	require.False(t, again.Existed, "pruned: the key makes a new job")
	require.NotEqual(t, first.Job.ID, again.Job.ID)
	_, err = jobstore.NewStore(b.pool).Get(ctx, other)
	require.NoError(t, err, fmt.Sprintf("kind other keeps the default %v", outbox.DefaultRetention))
}

// syncBuffer is a log destination a test reads while the logger writes.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// Reconcilers in several workers prune at once: each row goes once, none
// is counted twice, and a kind a person keeps for ever keeps its jobs.
func TestConcurrentPrunesShareTheWork(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	t0 := time.Now()
	_, err := b.pool.Exec(ctx, `INSERT INTO keel_jobs (id, kind, business_key, queue, payload, max_retry, status, finished_at)
		SELECT gen_random_uuid()::text, 'k' || (g % 3), 'key' || g, 'default', '\x7b7d', 1,
			(ARRAY['succeeded', 'discarded', 'cancelled'])[1 + g % 3], $1::timestamptz - interval '40 days'
		FROM generate_series(1, 3000) g`, t0)
	require.NoError(t, err)
	setPolicy(t, b, ledger.Policy{Kind: "k0", Status: "succeeded"}) // for ever
	var rs []*outbox.Reconciler
	for range 3 {
		r := newReconciler(t, outbox.ReconcilerConfig{Pool: b.pool, Redis: b.opt, PruneBatch: 100})
		defer r.Close()
		rs = append(rs, r)
	}
	var wg sync.WaitGroup
	counts := make([]int, len(rs))
	for i, r := range rs {
		wg.Go(func() {
			n, err := outbox.PruneAt(ctx, r, t0)
			assert.NoError(t, err)
			counts[i] = n
		})
	}
	wg.Wait()
	kept := b.count(t, `SELECT count(*) FROM keel_jobs WHERE kind = 'k0' AND status = 'succeeded'`)
	require.Equal(t, 1000, kept, "k0's succeeded jobs are kept for ever")
	require.Equal(t, 1000, b.count(t, `SELECT count(*) FROM keel_jobs`))
	require.Equal(t, 2000, counts[0]+counts[1]+counts[2], "each pruned once, by one of them")
	var byKind uint64
	for _, r := range rs {
		for _, n := range r.PrunedByKind() {
			byKind += n
		}
	}
	require.EqualValues(t, 2000, byKind)
}

// A notice counts under the policy it was given under: dead letters noticed
// under a bound a person then lifted are not dropped the moment a bound is
// set again, but alerted again and dropped a notice later.
func TestDeadLetterNoticeDoesNotOutliveItsPolicy(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	t0 := time.Now()
	id := b.finished(t, "a", "old", "dead", t0.Add(-40*day))
	seen(t, b, t0.Add(-39*day), id)
	setPolicy(t, b, ledger.Policy{Kind: "a", Status: "dead", Keep: 30 * day})
	r := newReconciler(t, outbox.ReconcilerConfig{Pool: b.pool, Redis: b.opt, DeadDropNotice: day})
	defer r.Close()
	_, err := outbox.PruneAt(ctx, r, t0)
	require.NoError(t, err)
	require.Equal(t, map[string]int{"a": 1}, r.DeadLettersToDrop())
	// The alert fired; a person lifts the bound, and sets it again later.
	_, err = ledger.UnsetRetention(ctx, b.pool, "a", "dead", "ops", "keep them for now", ledger.At(t0.Add(time.Hour)))
	require.NoError(t, err)
	_, err = outbox.PruneAt(ctx, r, t0.Add(2*time.Hour))
	require.NoError(t, err)
	require.Empty(t, r.DeadLettersToDrop())
	require.NoError(t, ledger.SetRetention(ctx, b.pool, ledger.Policy{Kind: "a", Status: "dead", Keep: 30 * day}, "ops", "again",
		ledger.At(t0.Add(5*day))))
	n, err := outbox.PruneAt(ctx, r, t0.Add(5*day+time.Minute))
	require.NoError(t, err)
	require.Zero(t, n, "noticed under the lifted policy: alerted again first")
	require.Equal(t, map[string]int{"a": 1}, r.DeadLettersToDrop())
	n, err = outbox.PruneAt(ctx, r, t0.Add(6*day+2*time.Minute))
	require.NoError(t, err)
	require.Equal(t, 1, n)
}

// `keel ledger`'s "prunable now" is what a prune then deletes: each kind's
// retention per status (a person's over the code's over Retention, for
// ever too), and the seen dead letters past a bound whose notice has run.
func TestPrunableIsWhatThePruneDeletes(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	t0 := time.Now()
	b.finished(t, "a", "a-ok-3d", "succeeded", t0.Add(-3*day))
	b.finished(t, "a", "a-ok-1d", "succeeded", t0.Add(-1*day))
	b.finished(t, "a", "a-cancelled-3d", "cancelled", t0.Add(-3*day))
	b.finished(t, "b", "b-ok-12d", "succeeded", t0.Add(-12*day))
	b.finished(t, "b", "b-discarded-4d", "discarded", t0.Add(-4*day))
	b.finished(t, "c", "c-ok-20d", "succeeded", t0.Add(-20*day))
	b.finished(t, "c", "c-ok-70d", "succeeded", t0.Add(-70*day))
	b.finished(t, "d", "d-ok-400d", "succeeded", t0.Add(-400*day))
	b.finished(t, "d", "d-cancelled-400d", "cancelled", t0.Add(-400*day))
	var dead []string
	for i := range 4 {
		dead = append(dead, b.finished(t, "e", fmt.Sprintf("e-dead-%d", i), "dead", t0.Add(-time.Duration(10-i)*day)))
	}
	seen(t, b, t0.Add(-time.Hour), dead...)
	setPolicy(t, b, ledger.Policy{Kind: "a", Status: "succeeded", Keep: 2 * day})
	setPolicy(t, b, ledger.Policy{Kind: "c", Status: "succeeded", Keep: 60 * day})
	setPolicy(t, b, ledger.Policy{Kind: "d", Status: "succeeded"}) // for ever
	setPolicy(t, b, ledger.Policy{Kind: "e", Status: "dead", MaxCount: 1})
	setPolicy(t, b, ledger.Policy{Kind: "d", Status: "cancelled"})
	require.NoError(t, ledger.DeclareRetention(ctx, b.pool, "b", []ledger.Policy{{Status: "discarded", Keep: 3 * day}}, "worker"))

	const retention = 10 * day
	r := newReconciler(t, outbox.ReconcilerConfig{Pool: b.pool, Redis: b.opt, Retention: retention, DeadDropNotice: day, PruneBatch: 1,
		Logger: slog.New(slog.DiscardHandler)})
	defer r.Close()
	// Now: a's 3-day-old success (2 days), b's 12-day-old one (the default
	// 10) and its discarded one (the code's 3), c's of 70 days (60); a day on, e's three oldest
	// seen dead letters, noticed by the first prune; 30 days on, the rest
	// but c's (60 days) and d's (for ever).
	for _, at := range []time.Time{t0, t0.Add(day + time.Minute), t0.Add(30 * day)} {
		want, err := ledger.Prunable(ctx, b.pool, retention, day, ledger.At(at))
		require.NoError(t, err)
		n, err := outbox.PruneAt(ctx, r, at)
		require.NoError(t, err)
		require.EqualValues(t, n, want, "at %s: prunable %d, pruned %d", at.Sub(t0), want, n)
		require.Positive(t, n, "at %s", at.Sub(t0))
	}
	require.Equal(t, []string{"c-ok-20d", "d-cancelled-400d", "d-ok-400d", "e-dead-3"}, b.keys(t))
}
