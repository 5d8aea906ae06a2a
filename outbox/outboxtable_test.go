package outbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/jobstore"
	"github.com/keeljobs/keel/outbox"
)

// publishBatch runs one pass of a relay with the default settings.
func (b *bundle) publishBatch(t *testing.T) (int, error) {
	t.Helper()
	relay := newRelay(t, outbox.RelayConfig{Pool: b.pool, Redis: b.opt})
	defer relay.Close()
	return relay.PublishBatch(context.Background())
}

// inspector looks at the test's Redis until the test ends.
func (b *bundle) inspector(t *testing.T) *asynq.Inspector {
	t.Helper()
	insp := asynq.NewInspector(b.opt)
	t.Cleanup(func() { insp.Close() })
	return insp
}

// rowVersion is the transaction that wrote the job's row as it is now.
func (b *bundle) rowVersion(t *testing.T, id string) string {
	t.Helper()
	var v string
	require.NoError(t, b.pool.QueryRow(context.Background(), `SELECT xmin::text FROM keel_jobs WHERE id = $1`, id).Scan(&v))
	return v
}

// Publishing an EnqueueTx job takes its outbox row and leaves the job's row
// as the enqueue wrote it: rewriting every job row (and an entry in each of
// its indexes) once more cost more Postgres work than the insert.
func TestRelayPublishesWithoutRewritingTheJobRow(t *testing.T) {
	b := setup(t)
	c := b.client(t, b.opt)
	id := enqueueTx(t, c, b, "untouched", nil)
	written := b.rowVersion(t, id)
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM keel_outbox WHERE job_id = $1`, id))

	n, err := b.publishBatch(t)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	insp := b.inspector(t)
	require.True(t, inRedis(t, insp, id))
	require.Equal(t, 0, b.count(t, `SELECT count(*) FROM keel_outbox`))
	require.Equal(t, written, b.rowVersion(t, id), "the relay rewrote the job's row")

	n, err = b.publishBatch(t)
	require.NoError(t, err)
	require.Zero(t, n, "a published job is not published again")
}

// A relay that took jobs off the outbox and died before publishing them
// loses nothing: past the grace, the reconciler publishes them. While a job
// is still on the outbox the reconciler leaves it to the relay, however
// old it is.
func TestOutboxJobsAreTheRelaysAndTheReconcilerTakesOverWhatARelayDropped(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	c := b.client(t, b.opt)
	waiting := enqueueTx(t, c, b, "still-on-the-outbox", nil)
	_, err := b.pool.Exec(ctx, `UPDATE keel_jobs SET updated_at = now() - interval '1 hour'`)
	require.NoError(t, err)
	rec := newReconciler(t, outbox.ReconcilerConfig{Pool: b.pool, Redis: b.opt, Grace: time.Minute})
	defer rec.Close()
	n, err := rec.Reconcile(ctx)
	require.NoError(t, err)
	require.Zero(t, n, "a job on the outbox is the relay's to publish")
	insp := b.inspector(t)
	require.False(t, inRedis(t, insp, waiting))

	// A relay takes it off the outbox and dies before it reaches Redis.
	store := jobstore.NewStore(b.pool)
	jobs, taken, err := store.ClaimOutbox(ctx, 10)
	require.NoError(t, err)
	require.Equal(t, 1, taken)
	require.Len(t, jobs, 1)
	require.Equal(t, waiting, jobs[0].ID)
	require.Equal(t, 0, b.count(t, `SELECT count(*) FROM keel_outbox`))

	n, err = rec.Reconcile(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, n, "the reconciler publishes what the dead relay took")
	require.True(t, inRedis(t, insp, waiting))
}

// An outbox row whose job was cancelled, or deleted, before a relay got to
// it is dropped, and nothing reaches Redis for it.
func TestRelayDropsOutboxRowsOfJobsNoLongerPending(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	c := b.client(t, b.opt)
	kept := enqueueTx(t, c, b, "kept", nil)
	cancelled := enqueueTx(t, c, b, "cancelled", nil)
	deleted := enqueueTx(t, c, b, "deleted", nil)
	res, err := c.Cancel(ctx, cancelled)
	require.NoError(t, err)
	require.Equal(t, idempotency.StatusCancelled, res.Job.Status)
	_, err = b.pool.Exec(ctx, `DELETE FROM keel_jobs WHERE id = $1`, deleted)
	require.NoError(t, err)

	n, err := b.publishBatch(t)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	require.Equal(t, 0, b.count(t, `SELECT count(*) FROM keel_outbox`))
	insp := b.inspector(t)
	require.True(t, inRedis(t, insp, kept))
	require.False(t, inRedis(t, insp, cancelled))
	require.False(t, inRedis(t, insp, deleted))
}

// Rows written unpublished and off the outbox (by a binary from before the
// outbox during a rolling deploy, a hand-back, a wait) are still published:
// by a sleeping relay when their writer notifies, and by an awake relay,
// which writers do not notify, within its slower poll of them.
func TestRelayPublishesRowsWrittenOffTheOutbox(t *testing.T) {
	b := setup(t)
	c := b.client(t, b.opt)
	insp := b.inspector(t)
	relay := newRelay(t, outbox.RelayConfig{Pool: b.pool, Redis: b.opt, PollInterval: time.Hour, IdleAfter: time.Hour})
	signals := runRelay(t, relay)
	oldWriter := func(key string, notify bool) string { return writeUnpublished(t, b, key, notify) }

	asleep := oldWriter("old-writer-asleep", true)
	waitPublished(t, signals)
	require.True(t, inRedis(t, insp, asleep), "a sleeping relay did not publish a notified row")
	// The notified row woke the relay; it may sleep again only after an
	// hour without work.
	awake := enqueueTx(t, c, b, "wakes-the-relay", nil)
	require.Equal(t, outbox.RelayAwake, waitPublished(t, signals).State, "the relay did not wake")
	require.True(t, inRedis(t, insp, awake))
	unnotified := oldWriter("old-writer-awake", false)
	waitPublished(t, signals)
	require.True(t, inRedis(t, insp, unnotified), "an awake relay did not publish a row off the outbox")
	require.Equal(t, 0, b.count(t, `SELECT count(*) FROM keel_jobs WHERE published_at IS NULL`))
}

// A claim that fails after taking rows off the outbox (here: its read of
// the jobs cannot get at keel_jobs, and the server gives up waiting) puts
// them back, and the next pass publishes them; nothing waits for the
// reconciler.
func TestOutboxClaimThatFailsPutsTheRowsBack(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	c := b.client(t, b.opt)
	id := enqueueTx(t, c, b, "claim-fails", nil)
	lock, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	defer lock.Rollback(ctx)
	_, err = lock.Exec(ctx, `LOCK TABLE keel_jobs IN ACCESS EXCLUSIVE MODE`)
	require.NoError(t, err)
	// The server ends the claim (a client that only stops waiting leaves
	// it running, and it may still commit once the lock is gone).
	cfg := b.pool.Config()
	cfg.ConnConfig.RuntimeParams["lock_timeout"] = "200ms"
	impatient, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	defer impatient.Close()
	_, _, err = jobstore.NewStore(impatient).ClaimOutbox(ctx, 10)
	require.ErrorContains(t, err, "lock timeout")
	require.NoError(t, lock.Rollback(ctx))
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM keel_outbox WHERE job_id = $1`, id), "the failed claim dropped the row")

	n, err := b.publishBatch(t)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	insp := b.inspector(t)
	require.True(t, inRedis(t, insp, id))
}

// A job that went back to unpublished while its outbox row was still there
// (published meanwhile by an older binary's reconciler, run, and handed
// back by a worker to wait) is left to its run_at: asynq may still hold its
// old copy. One handed back to run now is published once, not from both
// sources.
func TestOutboxRowOfAJobHandedBackIsLeftToTheUnpublishedClaim(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	c := b.client(t, b.opt)
	waits := enqueueTx(t, c, b, "waits", nil)
	due := enqueueTx(t, c, b, "due", nil)
	_, err := b.pool.Exec(ctx, `UPDATE keel_jobs SET published_at = NULL, run_at = now() + interval '1 hour' WHERE id = $1`, waits)
	require.NoError(t, err)
	_, err = b.pool.Exec(ctx, `UPDATE keel_jobs SET published_at = NULL WHERE id = $1`, due)
	require.NoError(t, err)

	n, err := b.publishBatch(t)
	require.NoError(t, err)
	require.Equal(t, 1, n, "the due job, once")
	insp := b.inspector(t)
	require.True(t, inRedis(t, insp, due))
	require.False(t, inRedis(t, insp, waits), "a job waiting for its run_at was published")
	require.Equal(t, 0, b.count(t, `SELECT count(*) FROM keel_outbox`))
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM keel_jobs WHERE published_at IS NULL`), "the waiting job is the unpublished claim's")
}

// A job whose outbox row no relay has taken for a minute (only older
// binaries' relays run, mid-deploy, or none) is published by the
// reconciler, which takes the row as a relay would: one of them publishes
// it. A younger row is left to the relays.
func TestReconcilerPublishesOutboxJobsNoRelayTakes(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	c := b.client(t, b.opt)
	id := enqueueTx(t, c, b, "no-relay", nil)
	young := enqueueTx(t, c, b, "young", nil)
	_, err := b.pool.Exec(ctx, `UPDATE keel_jobs SET updated_at = now() - interval '1 hour'`)
	require.NoError(t, err)
	_, err = b.pool.Exec(ctx, `UPDATE keel_outbox SET queued_at = now() - interval '2 minutes' WHERE job_id = $1`, id)
	require.NoError(t, err)
	rec := newReconciler(t, outbox.ReconcilerConfig{Pool: b.pool, Redis: b.opt, Grace: time.Minute})
	defer rec.Close()
	n, err := rec.Reconcile(ctx)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	insp := b.inspector(t)
	require.True(t, inRedis(t, insp, id))
	require.False(t, inRedis(t, insp, young))
	require.Equal(t, 0, b.count(t, `SELECT count(*) FROM keel_outbox WHERE job_id = $1`, id), "the reconciler left the row to a relay too")
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM keel_outbox WHERE job_id = $1`, young))
}

// An outbox the relay cannot read (here: gone; in life, say, a role
// without a grant on it) does not hold up the rows written unpublished.
func TestABrokenOutboxDoesNotHoldUpRowsWrittenUnpublished(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	store := jobstore.NewStore(b.pool)
	j, _, err := store.Insert(ctx, b.pool, jobstore.NewJob{Kind: work.Name(), BusinessKey: "unpublished", Queue: "default",
		Payload: []byte(`{"id":"unpublished"}`), MaxRetry: 3})
	require.NoError(t, err)
	_, err = b.pool.Exec(ctx, `ALTER TABLE keel_outbox RENAME TO keel_outbox_gone`)
	require.NoError(t, err)

	n, err := b.publishBatch(t)
	require.ErrorContains(t, err, "keel_outbox")
	require.Equal(t, 1, n)
	insp := b.inspector(t)
	require.True(t, inRedis(t, insp, j.ID))
}

// Outbox rows whose jobs are gone (here more than a relay takes at once)
// do not hold up the jobs behind them: the relay keeps taking rows while
// it takes full batches, whatever it drops.
func TestOutboxRowsOfGoneJobsDoNotHoldUpTheRest(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	_, err := b.pool.Exec(ctx, `INSERT INTO keel_outbox (job_id, queued_at)
		SELECT 'gone-' || g, now() - interval '1 minute' FROM generate_series(1, 450) g`)
	require.NoError(t, err)
	// Asleep, and it stays asleep unless a pass publishes something: only
	// a pass that goes on past the dropped rows finds the job.
	relay := newRelay(t, outbox.RelayConfig{Pool: b.pool, Redis: b.opt, PollInterval: time.Hour, BatchSize: 200})
	signals := runRelay(t, relay)
	c := b.client(t, b.opt)
	id := enqueueTx(t, c, b, "behind-the-gone", nil)
	insp := b.inspector(t)
	waitPublished(t, signals)
	require.True(t, inRedis(t, insp, id), "the job behind the dropped rows was not published")
	require.Equal(t, 0, b.count(t, `SELECT count(*) FROM keel_outbox`))
}

// A relay that cannot read its outbox still drains the rows written
// unpublished, batch after batch, in one pass.
func TestRelayWithABrokenOutboxStillDrainsRowsWrittenUnpublished(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	_, err := b.pool.Exec(ctx, `INSERT INTO keel_jobs (id, kind, business_key, queue, payload, max_retry)
		SELECT 'unpublished-' || g, $1, 'key-' || g, 'default', '{"id":"x"}', 3 FROM generate_series(1, 450) g`, work.Name())
	require.NoError(t, err)
	_, err = b.pool.Exec(ctx, `ALTER TABLE keel_outbox RENAME TO keel_outbox_gone`)
	require.NoError(t, err)
	// Its first pass, at start, is the only one before an hour's poll.
	relay := newRelay(t, outbox.RelayConfig{Pool: b.pool, Redis: b.opt, PollInterval: time.Hour, BatchSize: 200})
	pass := runRelay(t, relay).Passed.Wait(t)
	require.ErrorContains(t, pass.Err, "keel_outbox")
	require.Equal(t, 450, pass.Published, "the relay stopped draining when its outbox failed")
}

// A writer of an unpublished row that notifies (a replay, a batch's
// callback, an older binary) has it published at once by the awake relay,
// not at the relay's next look at such rows (an hour here).
func TestAwakeRelayClaimsANotifiedUnpublishedRowAtOnce(t *testing.T) {
	outbox.SetLegacyPollForTest(t, time.Hour)
	b := setupAlone(t)
	c := b.client(t, b.opt)
	insp := b.inspector(t)
	relay := newRelay(t, outbox.RelayConfig{Pool: b.pool, Redis: b.opt, PollInterval: time.Hour, IdleAfter: time.Hour})
	signals := runRelay(t, relay)
	awake := enqueueTx(t, c, b, "wakes-the-relay", nil)
	require.Equal(t, outbox.RelayAwake, waitPublished(t, signals).State, "the relay did not wake")
	require.True(t, inRedis(t, insp, awake))

	id := writeUnpublished(t, b, "notified", true)
	waitPublished(t, signals)
	require.True(t, inRedis(t, insp, id), "the awake relay left a notified row to its next look")
}

// writeUnpublished commits a job as an older binary (or a replay) writes
// one: unpublished, off the outbox, notifying the relays if notify.
func writeUnpublished(t *testing.T, b *bundle, key string, notify bool) string {
	t.Helper()
	ctx := context.Background()
	tx, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck // no-op after commit
	j, _, err := jobstore.NewStore(b.pool).Insert(ctx, tx, jobstore.NewJob{Kind: work.Name(), BusinessKey: key, Queue: "default",
		Payload: []byte(`{"id":"` + key + `"}`), MaxRetry: 3})
	require.NoError(t, err)
	require.Nil(t, j.PublishedAt)
	if notify {
		require.NoError(t, jobstore.NotifyRelay(ctx, tx))
	}
	require.NoError(t, tx.Commit(ctx))
	return j.ID
}
