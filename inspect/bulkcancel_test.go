package inspect_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/inspect"
	"github.com/keeljobs/keel/internal/jobstore"
)

// keyed enqueues a job of kind under concurrency key at limit, and
// returns its id and status (pending, or waiting when held for a slot).
func (b *bundle) keyed(t *testing.T, kind, key string, limit int, n int) (string, idempotency.Status) {
	t.Helper()
	j, _, err := jobstore.NewStore(b.pool).Insert(context.Background(), b.pool, jobstore.NewJob{Kind: kind,
		BusinessKey: fmt.Sprintf("%s-%d", key, n), Queue: "default", Payload: []byte(`{}`), MaxRetry: 3,
		ConcurrencyKey: key, ConcurrencyLimit: limit})
	require.NoError(t, err)
	return j.ID, b.status(t, j.ID)
}

// "Cancel every open job of kind K" cancels the jobs a kind's pause holds
// and those held for a concurrency slot too, and the count confirmed
// before is of them all.
func TestCancelByFilterTakesPausedAndHeldJobs(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	kind := "bulkcancel:sync"
	first, st := b.keyed(t, kind, "tenant-a", 1, 1)
	require.Equal(t, idempotency.StatusPending, st)
	held, st := b.keyed(t, kind, "tenant-a", 1, 2)
	require.Equal(t, idempotency.StatusWaiting, st, "held for tenant-a's one slot")
	running := b.put(t, kind, "running")
	pending := b.put(t, kind, "pending")
	other := b.put(t, "bulkcancel:other", "pending")
	_, err := b.ops.PauseKind(ctx, kind, "ops", "hold")
	require.NoError(t, err)
	require.Equal(t, idempotency.StatusPaused, b.status(t, pending))
	require.Equal(t, idempotency.StatusPaused, b.status(t, first))

	f := inspect.Filter{Open: true, Kind: kind}
	n, err := b.ops.Count(ctx, f)
	require.NoError(t, err)
	require.Equal(t, 4, n, "paused, held, running")
	ids, err := b.ops.IDs(ctx, f)
	require.NoError(t, err)
	require.ElementsMatch(t, []string{first, held, running, pending}, ids)
	dry, err := b.ops.DryRunMatching(ctx, inspect.ActionCancel, inspect.Filter{Kind: kind})
	require.NoError(t, err)
	require.Equal(t, inspect.DryRun{Matched: 4, Would: 4, Refused: map[string]int{}}, dry)

	res, err := b.ops.CancelMatching(ctx, inspect.Filter{Kind: kind}, n, "ops", "tenant left")
	require.NoError(t, err)
	require.Equal(t, 4, res.Done)
	for _, id := range []string{first, held, running, pending} {
		require.Equal(t, idempotency.StatusCancelled, b.status(t, id))
	}
	require.Equal(t, idempotency.StatusPending, b.status(t, other))
	require.Zero(t, b.count(t, `SELECT count(*) FROM keel_jobs WHERE kind = $1 AND key_held_since IS NOT NULL`, kind),
		"a cancelled job waits for no slot")
}

// A cancelled job gives back only the slot it held: one held for a slot
// frees none, and one a kind's pause holds frees its own, so the job held
// behind it is not left waiting for a slot nobody has.
func TestCancelKeepsConcurrencySlotsRight(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	kind := "bulkcancel:slots"
	first, _ := b.keyed(t, kind, "tenant-a", 1, 1)
	second, st := b.keyed(t, kind, "tenant-a", 1, 2)
	require.Equal(t, idempotency.StatusWaiting, st)
	third, st := b.keyed(t, kind, "tenant-a", 1, 3)
	require.Equal(t, idempotency.StatusWaiting, st)

	// The held second one: the slot stays the first's, the third held.
	_, err := b.ops.Cancel(ctx, second, "ops", "not needed")
	require.NoError(t, err)
	require.Equal(t, idempotency.StatusPending, b.status(t, first))
	require.Equal(t, idempotency.StatusWaiting, b.status(t, third))

	// The first, held by its kind's pause: its slot goes to the third.
	_, err = b.ops.PauseKind(ctx, kind, "ops", "hold")
	require.NoError(t, err)
	require.Equal(t, idempotency.StatusPaused, b.status(t, first))
	res, err := b.ops.CancelMatching(ctx, inspect.Filter{Kind: kind, Until: createdAt(t, b, second)}, 1, "ops", "not needed")
	require.NoError(t, err)
	require.Equal(t, 1, res.Done)
	require.Equal(t, idempotency.StatusCancelled, b.status(t, first))
	_, err = b.ops.ResumeKind(ctx, kind, "ops", "back")
	require.NoError(t, err)
	require.Equal(t, idempotency.StatusPending, b.status(t, third), "the slot the cancelled job held is free")
	keys, err := b.ops.ConcurrencyKeys(ctx, kind, "tenant-a", 10)
	require.NoError(t, err)
	require.Len(t, keys, 1)
	require.Equal(t, 1, keys[0].InFlight)
	require.Zero(t, keys[0].Held)
}

// The jobs a kind's pause holds keep their slots while it lasts: one of
// them cancelled frees its own slot only, not those of the others.
func TestCancelOfAPausedJobFreesOneSlot(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	kind := "bulkcancel:two"
	var ids []string
	for i := range 4 {
		id, _ := b.keyed(t, kind, "tenant-b", 2, i)
		ids = append(ids, id)
	}
	_, err := b.ops.PauseKind(ctx, kind, "ops", "hold")
	require.NoError(t, err)
	require.Equal(t, []idempotency.Status{idempotency.StatusPaused, idempotency.StatusPaused, idempotency.StatusWaiting,
		idempotency.StatusWaiting}, b.statuses(t, ids...))
	_, err = b.ops.Cancel(ctx, ids[0], "ops", "not needed")
	require.NoError(t, err)
	require.Equal(t, []idempotency.Status{idempotency.StatusCancelled, idempotency.StatusPaused, idempotency.StatusPending,
		idempotency.StatusWaiting}, b.statuses(t, ids...), "the oldest held job takes the one slot; the paused one keeps its own")
}

func (b *bundle) statuses(t *testing.T, ids ...string) []idempotency.Status {
	t.Helper()
	out := make([]idempotency.Status, len(ids))
	for i, id := range ids {
		out[i] = b.status(t, id)
	}
	return out
}

func createdAt(t *testing.T, b *bundle, id string) (at time.Time) {
	t.Helper()
	require.NoError(t, b.pool.QueryRow(context.Background(), `SELECT created_at FROM keel_jobs WHERE id = $1`, id).Scan(&at))
	return at
}

// A cancel of many jobs, in pages, does not release the jobs of its later
// pages that a key holds: cancelling a job in flight frees its slot, and the
// oldest held job of its key would go to the relay (and a worker) before
// its own page came. Held jobs are cancelled first.
func TestCancelByFilterReleasesNoneOfTheJobsItCancels(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	kind := "bulkcancel:pages"
	first, st := b.keyed(t, kind, "tenant-c", 1, 1)
	require.Equal(t, idempotency.StatusPending, st)
	// More than a page between the job in flight and the one held behind
	// it, oldest first.
	_, err := b.pool.Exec(ctx, `INSERT INTO keel_jobs (id, kind, business_key, queue, payload, max_retry)
		SELECT gen_random_uuid()::text, $1, 'filler-' || g, 'default', '{}', 3 FROM generate_series(1, 600) g`, kind)
	require.NoError(t, err)
	held, st := b.keyed(t, kind, "tenant-c", 1, 2)
	require.Equal(t, idempotency.StatusWaiting, st)
	_, err = b.pool.Exec(ctx, `CREATE TABLE moves (id text, was text, now text);
		CREATE FUNCTION record_move() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN INSERT INTO moves VALUES (NEW.id, OLD.status, NEW.status); RETURN NULL; END $$;
		CREATE TRIGGER record_move AFTER UPDATE OF status ON keel_jobs FOR EACH ROW EXECUTE FUNCTION record_move()`)
	require.NoError(t, err)

	res, err := b.ops.CancelMatching(ctx, inspect.Filter{Kind: kind}, 602, "ops", "tenant left")
	require.NoError(t, err)
	require.Equal(t, 602, res.Done)
	require.Equal(t, []idempotency.Status{idempotency.StatusCancelled, idempotency.StatusCancelled}, b.statuses(t, first, held))
	require.Zero(t, b.count(t, `SELECT count(*) FROM moves WHERE id = $1 AND now = 'pending'`, held),
		"the cancel released a job it was to cancel")
}

// A cancel of more than a page names the ids of no job among its failures,
// as a page does, after taking the others in its own order.
func TestBulkCancelOfManyNamesTheUnknownIDs(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	kind := "bulkcancel:unknown"
	_, err := b.pool.Exec(ctx, `INSERT INTO keel_jobs (id, kind, business_key, queue, payload, max_retry)
		SELECT gen_random_uuid()::text, $1, 'filler-' || g, 'default', '{}', 3 FROM generate_series(1, 600) g`, kind)
	require.NoError(t, err)
	ids, err := b.ops.IDs(ctx, inspect.Filter{Open: true, Kind: kind})
	require.NoError(t, err)
	require.Len(t, ids, 600)
	res, err := b.ops.Bulk(ctx, inspect.ActionCancel, append([]string{"no-such-job"}, ids...), "ops", "tenant left", nil)
	require.NoError(t, err)
	require.Equal(t, 601, res.Matched)
	require.Equal(t, 600, res.Done)
	require.Len(t, res.Failed, 1)
	require.ErrorIs(t, res.Failed["no-such-job"], inspect.ErrNotFound)
}
