package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/internal/ledger"
	"github.com/keeljobs/keel/outbox"
	"github.com/keeljobs/keel/tasks"
)

// enqueueTx commits one job with EnqueueTx, calling check inside the
// transaction first, and returns the job's id.
func enqueueTx(t *testing.T, c *tasks.Client, b *bundle, key string, check func(pgx.Tx)) string {
	t.Helper()
	var id string
	require.NoError(t, pgx.BeginFunc(context.Background(), b.pool, func(tx pgx.Tx) error {
		res, err := c.EnqueueTx(context.Background(), tx, work.New(item{ID: key}))
		if err != nil {
			return err
		}
		id = res.Job.ID
		if check != nil {
			check(tx)
		}
		return nil
	}))
	return id
}

// runRelay runs r until the test ends, waits until it listens, and
// returns its test signals.
func runRelay(t *testing.T, r *outbox.Relay) *outbox.RelaySignals {
	t.Helper()
	signals := outbox.InitRelaySignals(r)
	startRelay(t, r)
	signals.Listening.Wait(t)
	require.True(t, r.Listening())
	return signals
}

// startRelay runs r until the test ends.
func startRelay(t *testing.T, r *outbox.Relay) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = r.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done; r.Close() })
}

// waitPublished waits for the relay's next look that published a job and
// returns it.
func waitPublished(t *testing.T, signals *outbox.RelaySignals) outbox.RelayPass {
	t.Helper()
	return signals.Passed.WaitFor(t, func(p outbox.RelayPass) bool { return p.Published > 0 })
}

// waitState waits for the relay's next look that left it in state.
func waitState(t *testing.T, signals *outbox.RelaySignals, state outbox.RelayState) outbox.RelayPass {
	t.Helper()
	return signals.Passed.WaitFor(t, func(p outbox.RelayPass) bool { return p.State == state })
}

// relayLocksHeld tells which relay locks tx holds: every writer holds the
// settle lock; only one that notified holds the awake lock.
func relayLocksHeld(t *testing.T, tx pgx.Tx) (settle, awake bool) {
	t.Helper()
	held := func(lock string) bool {
		var n int
		require.NoError(t, tx.QueryRow(context.Background(), `SELECT count(*) FROM pg_locks, (VALUES (`+lock+`)) AS k (k1, k2)
			WHERE pid = pg_backend_pid() AND locktype = 'advisory' AND classid = k1::int8::oid AND objid = k2::int8::oid
			AND objsubid = 2 AND granted`).Scan(&n))
		return n > 0
	}
	return held(ledger.RelaySettleLock), held(ledger.RelayAwakeLock)
}

// inRedis tells whether asynq holds the task of job id.
func inRedis(t *testing.T, insp *asynq.Inspector, id string) bool {
	t.Helper()
	_, err := insp.GetTaskInfo("default", id)
	if errors.Is(err, asynq.ErrTaskNotFound) || errors.Is(err, asynq.ErrQueueNotFound) {
		return false
	}
	require.NoError(t, err)
	return true
}

// A burst larger than a batch goes to Redis with several publishes in
// flight, every job once: the queue holds exactly the ledger's ids.
func TestRelayPublishesBurstEachJobOnce(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	c := b.client(t, b.opt)
	const n = 1000
	want := map[string]bool{}
	require.NoError(t, pgx.BeginFunc(ctx, b.pool, func(tx pgx.Tx) error {
		for i := range n {
			res, err := c.EnqueueTx(ctx, tx, work.New(item{ID: fmt.Sprint("burst-", i)}))
			if err != nil {
				return err
			}
			want[res.Job.ID] = true
		}
		return nil
	}))
	r1 := newRelay(t, outbox.RelayConfig{Pool: b.pool, Redis: b.opt, PollInterval: time.Hour})
	r2 := newRelay(t, outbox.RelayConfig{Pool: b.pool, Redis: b.opt, PollInterval: time.Hour})
	signals := runRelay(t, r1)
	outbox.ShareRelaySignals(r2, signals)
	startRelay(t, r2)
	signals.Listening.Wait(t)
	published := 0
	for published < n {
		published += signals.Passed.Wait(t).Published
	}
	require.Equal(t, n, published, "a job was published twice")
	require.EqualValues(t, n, r1.Published()+r2.Published())
	require.Equal(t, 0, b.count(t, `SELECT count(*) FROM keel_jobs WHERE published_at IS NULL`))

	insp := asynq.NewInspector(b.opt)
	defer insp.Close()
	got := map[string]bool{}
	for page := 1; ; page++ {
		tasks, err := insp.ListPendingTasks("default", asynq.Page(page), asynq.PageSize(200))
		require.NoError(t, err)
		if len(tasks) == 0 {
			break
		}
		for _, ti := range tasks {
			require.False(t, got[ti.ID], "task %s is in Redis twice", ti.ID)
			got[ti.ID] = true
		}
	}
	require.Equal(t, want, got)
}

// While a relay is awake a writer does not notify (its commit takes no
// database-wide lock), and the job still reaches Redis at once: the relay
// polls. Its poll interval, an hour, rules the fallback out.
func TestAwakeRelayPublishesWithoutNotification(t *testing.T) {
	b := setup(t)
	c := b.client(t, b.opt)
	r := newRelay(t, outbox.RelayConfig{Pool: b.pool, Redis: b.opt, PollInterval: time.Hour, IdleAfter: time.Hour})
	signals := runRelay(t, r)
	insp := asynq.NewInspector(b.opt)
	defer insp.Close()

	first := enqueueTx(t, c, b, "first", func(tx pgx.Tx) {
		settle, awake := relayLocksHeld(t, tx)
		require.True(t, settle)
		require.True(t, awake, "with no relay awake the writer must notify")
	})
	pass := waitPublished(t, signals)
	require.Equal(t, outbox.RelayAwake, pass.State, "the relay did not stay awake after finding work")
	require.True(t, inRedis(t, insp, first))

	second := enqueueTx(t, c, b, "second", func(tx pgx.Tx) {
		settle, awake := relayLocksHeld(t, tx)
		require.True(t, settle, "a writer that skips the notification holds the settle lock")
		require.False(t, awake, "a writer must not notify an awake relay")
	})
	pass = waitPublished(t, signals)
	require.Equal(t, outbox.RelayAwake, pass.State)
	require.True(t, inRedis(t, insp, second), "the awake relay did not poll")
}

// A relay that found nothing for IdleAfter goes back to sleep; then the
// writer notifies again, and the notification wakes it.
func TestIdleRelaySleepsAndIsWokenAgain(t *testing.T) {
	b := setup(t)
	c := b.client(t, b.opt)
	r := newRelay(t, outbox.RelayConfig{Pool: b.pool, Redis: b.opt, PollInterval: time.Hour, IdleAfter: time.Hour})
	clock := outbox.MoveRelayClock(r)
	signals := runRelay(t, r)
	insp := asynq.NewInspector(b.opt)
	defer insp.Close()
	first := enqueueTx(t, c, b, "first", nil)
	require.Equal(t, outbox.RelayAwake, waitPublished(t, signals).State, "the notification did not wake the relay")
	require.True(t, inRedis(t, insp, first))
	clock.Add(time.Hour)
	waitState(t, signals, outbox.RelayAsleep)

	second := enqueueTx(t, c, b, "second", func(tx pgx.Tx) {
		_, awake := relayLocksHeld(t, tx)
		require.True(t, awake, "with the relay asleep the writer must notify")
	})
	waitPublished(t, signals)
	require.True(t, inRedis(t, insp, second), "the sleeping relay was not woken")
}

// A writer that counted on the awake relay and commits after the relay let
// go of the awake lock is still published: the relay waits for it before
// it sleeps.
func TestSettlingRelayWaitsForWritersThatDidNotNotify(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	c := b.client(t, b.opt)
	// The relay stays awake until the test moves its clock past IdleAfter.
	r := newRelay(t, outbox.RelayConfig{Pool: b.pool, Redis: b.opt, PollInterval: time.Hour, IdleAfter: time.Hour})
	clock := outbox.MoveRelayClock(r)
	signals := runRelay(t, r)
	insp := asynq.NewInspector(b.opt)
	defer insp.Close()
	first := enqueueTx(t, c, b, "first", nil)
	require.Equal(t, outbox.RelayAwake, waitPublished(t, signals).State, "the notification did not wake the relay")
	require.True(t, inRedis(t, insp, first))

	tx, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck // no-op after commit
	res, err := c.EnqueueTx(ctx, tx, work.New(item{ID: "straggler"}))
	require.NoError(t, err)
	settle, awake := relayLocksHeld(t, tx)
	require.True(t, settle)
	require.False(t, awake, "the relay was awake: the writer must not notify")
	// The relay lets go of the awake lock after IdleAfter but cannot
	// settle while the writer is open: its next look, after it let go,
	// finds the writer and keeps it settling.
	clock.Add(time.Hour)
	require.Equal(t, outbox.RelaySettling, signals.Passed.Wait(t).State, "the relay did not let go of the awake lock")
	require.Equal(t, 0, b.count(t, `SELECT count(*) FROM pg_locks, (VALUES (`+ledger.RelayAwakeLock+`)) AS k (k1, k2)
		WHERE locktype = 'advisory' AND classid = k1::int8::oid AND objid = k2::int8::oid AND objsubid = 2
		AND mode = 'ExclusiveLock' AND granted`), "the relay kept the awake lock")
	require.Equal(t, outbox.RelaySettling, signals.Passed.Wait(t).State, "the relay slept before the writer that counted on it ended")
	require.NoError(t, tx.Commit(ctx))
	pass := waitPublished(t, signals)
	require.True(t, inRedis(t, insp, res.Job.ID), "the straggler's job was not published")
	if pass.State != outbox.RelayAsleep {
		clock.Add(time.Hour) // woken again by the straggler's job
		waitState(t, signals, outbox.RelayAsleep)
	}
}

// A rolled-back transaction publishes nothing, with the relay awake or
// asleep: the job written after it is published, it is not.
func TestRolledBackEnqueueTxPublishesNothing(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	c := b.client(t, b.opt)
	r := newRelay(t, outbox.RelayConfig{Pool: b.pool, Redis: b.opt, PollInterval: time.Hour, IdleAfter: time.Hour})
	signals := runRelay(t, r)
	insp := asynq.NewInspector(b.opt)
	defer insp.Close()
	for round, state := range []string{"asleep", "awake"} {
		var rolledBack string
		err := pgx.BeginFunc(ctx, b.pool, func(tx pgx.Tx) error {
			res, err := c.EnqueueTx(ctx, tx, work.New(item{ID: "rolled-back-" + state}))
			require.NoError(t, err)
			rolledBack = res.Job.ID
			return errors.New("roll back")
		})
		require.Error(t, err)
		after := enqueueTx(t, c, b, fmt.Sprint("after-", round), nil)
		pass := waitPublished(t, signals)
		require.Equal(t, 1, pass.Published, "relay %s", state)
		require.Equal(t, outbox.RelayAwake, pass.State, "the relay did not wake")
		require.True(t, inRedis(t, insp, after), "the relay (%s) did not publish", state)
		require.False(t, inRedis(t, insp, rolledBack), "a rolled-back job reached Redis (relay %s)", state)
		require.Equal(t, 0, b.count(t, `SELECT count(*) FROM keel_jobs WHERE id = $1`, rolledBack))
	}
	require.EqualValues(t, 2, r.Published())
}
