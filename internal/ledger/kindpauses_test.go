package ledger_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/internal/ledger"
	"github.com/keeljobs/keel/internal/testenv"
)

// A kind's pause holds its waiting jobs, and only its; a delivery's claim
// of a job of a paused kind does not take and holds the job instead; the
// resume releases them all to the relay, unpublished. Pause and resume are
// audited once each.
func TestKindPauses(t *testing.T) {
	ctx := context.Background()
	for name, call := range map[string]func(db ledger.DB){
		"hold":    func(db ledger.DB) { ledger.HoldKind(ctx, db, "kind3") },          //nolint:errcheck
		"release": func(db ledger.DB) { ledger.ReleaseKind(ctx, db, "kind3") },       //nolint:errcheck
		"pauses":  func(db ledger.DB) { ledger.KindPauses(ctx, db) },                 //nolint:errcheck
		"held":    func(db ledger.DB) { ledger.PausedByKind(ctx, db) },               //nolint:errcheck
		"late":    func(db ledger.DB) { ledger.HeldPastDeadline(ctx, db, 100, nil) }, //nolint:errcheck
	} {
		p := plan(t, call)
		ix := []string{"keel_jobs_paused"}
		switch name {
		case "hold":
			ix = []string{"keel_jobs_open"}
		case "late":
			ix = []string{"keel_jobs_paused_deadline"}
		}
		usesIndex(t, p, ix, "keel_jobs")
	}

	tx, err := big.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck
	var open int64
	require.NoError(t, tx.QueryRow(ctx, `SELECT count(*) FROM keel_jobs WHERE kind = 'kind3' AND status IN ('pending', 'failed')`).Scan(&open))
	require.NotZero(t, open)
	n, err := ledger.HoldKind(ctx, tx, "kind3")
	require.NoError(t, err)
	require.Zero(t, n, "held without a pause")

	done, err := ledger.PauseKind(ctx, tx, "kind3", "ops:ann", "the supplier is down")
	require.NoError(t, err)
	require.True(t, done)
	done, err = ledger.PauseKind(ctx, tx, "kind3", "ops:bo", "again")
	require.NoError(t, err)
	require.False(t, done)
	n, err = ledger.HoldKind(ctx, tx, "kind3")
	require.NoError(t, err)
	require.Equal(t, open, n)

	// A claim of a pending job of the paused kind holds it; one of
	// another kind is untouched by the pause.
	var k3, k4 string
	require.NoError(t, tx.QueryRow(ctx, `INSERT INTO keel_jobs (id, kind, business_key, queue, payload, max_retry, status, published_at, run_at)
		VALUES ('p3', 'kind3', 'pk3', 'default', '\x7b7d', 3, 'pending', now(), now()),
		       ('p4', 'kind4', 'pk4', 'default', '\x7b7d', 3, 'pending', now(), now()) RETURNING 'p3'`).Scan(&k3))
	k4 = "p4"
	var claimed []string
	require.NoError(t, ledger.Round(ctx, tx, ledger.RoundArgs{Holder: "w", LeaseMS: 1000, Claim: []string{k3, k4}}, func(c ledger.Claimed) {
		claimed = append(claimed, c.ID)
	}))
	require.Equal(t, []string{k4}, claimed)
	var why []ledger.Unclaimed
	require.NoError(t, ledger.ReadUnclaimed(ctx, tx, []string{k3}, func(u ledger.Unclaimed) { why = append(why, u) }))
	require.Len(t, why, 1)
	require.Equal(t, ledger.StatusPaused, why[0].Status)
	require.False(t, why[0].Exhausted)

	ps, err := ledger.KindPauses(ctx, tx)
	require.NoError(t, err)
	require.Len(t, ps, 1)
	require.Equal(t, "ops:ann", ps[0].PausedBy)
	require.Equal(t, open+1, ps[0].Held)
	held, err := ledger.PausedByKind(ctx, tx)
	require.NoError(t, err)
	require.Equal(t, map[string]int64{"kind3": open + 1}, held)

	// A held job past its deadline ends as one waiting in Redis would.
	_, err = tx.Exec(ctx, `UPDATE keel_jobs SET deadline = now() - interval '1 second' WHERE id = 'p3'`)
	require.NoError(t, err)
	late, err := ledger.HeldPastDeadline(ctx, tx, 100, nil)
	require.NoError(t, err)
	require.Equal(t, []string{k3}, late)
	ended, err := ledger.EndPastDeadline(ctx, tx, late, 0, "", nil)
	require.NoError(t, err)
	require.Len(t, ended, 1)
	require.Equal(t, ledger.StatusDead, ended[0].Status)

	done, err = ledger.ResumeKind(ctx, tx, "kind3", "ops:ann", "back")
	require.NoError(t, err)
	require.True(t, done)
	n, err = ledger.ReleaseKind(ctx, tx, "kind3")
	require.NoError(t, err)
	require.Equal(t, open, n)
	var unpublished int64
	require.NoError(t, tx.QueryRow(ctx, `SELECT count(*) FROM keel_jobs WHERE kind = 'kind3' AND status = 'pending' AND published_at IS NULL`).Scan(&unpublished))
	require.Equal(t, n, unpublished)
	done, err = ledger.ResumeKind(ctx, tx, "kind3", "ops:ann", "again")
	require.NoError(t, err)
	require.False(t, done)
	var audited int
	require.NoError(t, tx.QueryRow(ctx, `SELECT count(*) FROM keel_audit WHERE action IN ('pause-kind:kind3', 'resume-kind:kind3')`).Scan(&audited))
	require.Equal(t, 2, audited)
}

// A hold that commits while a resume runs is released by that resume: the
// hold locks the pause row (its kind's, or its queue's), so the resume's
// delete waits for it and its release then sees the held job. Without the
// lock the job would stay held with no pause left to resume.
func TestAHoldDuringAResumeIsReleased(t *testing.T) {
	for _, c := range []struct {
		what   string
		pause  func(ctx context.Context, db ledger.DB) error
		resume func(ctx context.Context, tx pgx.Tx) error
	}{
		{"kind", func(ctx context.Context, db ledger.DB) error {
			_, err := ledger.PauseKind(ctx, db, "mail", "ops", "")
			return err
		}, func(ctx context.Context, tx pgx.Tx) error {
			if _, err := ledger.ResumeKind(ctx, tx, "mail", "ops", ""); err != nil {
				return err
			}
			_, err := ledger.ReleaseKind(ctx, tx, "mail")
			return err
		}},
		{"queue", func(ctx context.Context, db ledger.DB) error {
			_, err := ledger.PauseQueue(ctx, db, "default", "ops", "")
			return err
		}, func(ctx context.Context, tx pgx.Tx) error {
			if _, err := ledger.ResumeQueue(ctx, tx, "default", "ops", ""); err != nil {
				return err
			}
			_, err := ledger.ReleaseQueue(ctx, tx, "default")
			return err
		}},
	} {
		t.Run(c.what, func(t *testing.T) {
			pool, _ := testenv.PrivatePool(t)
			ctx := context.Background()
			_, err := pool.Exec(ctx, `INSERT INTO keel_jobs (id, kind, business_key, queue, payload, max_retry, status, published_at, run_at)
				VALUES ('j1', 'mail', 'k1', 'default', '\x7b7d', 3, 'pending', now(), now())`)
			require.NoError(t, err)
			require.NoError(t, c.pause(ctx, pool))

			// A delivery's claim did not take; its hold is not committed yet.
			hold, err := pool.Begin(ctx)
			require.NoError(t, err)
			defer hold.Rollback(ctx) //nolint:errcheck
			var why []ledger.Unclaimed
			require.NoError(t, ledger.ReadUnclaimed(ctx, hold, []string{"j1"}, func(u ledger.Unclaimed) { why = append(why, u) }))
			require.Equal(t, ledger.StatusPaused, why[0].Status)
			var holdPID int
			require.NoError(t, hold.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&holdPID))

			resumed := make(chan error, 1)
			go func() { resumed <- pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return c.resume(ctx, tx) }) }()
			// The resume waits for the hold's lock on the pause row.
			testenv.Eventually(t, 10*time.Second, func() bool {
				var waiting bool
				require.NoError(t, pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_stat_activity
					WHERE $1 = ANY (pg_blocking_pids(pid)))`, holdPID).Scan(&waiting))
				return waiting
			}, "the resume did not wait for the hold")
			require.NoError(t, hold.Commit(ctx))
			require.NoError(t, <-resumed)
			var st string
			require.NoError(t, pool.QueryRow(ctx, `SELECT status FROM keel_jobs WHERE id = 'j1'`).Scan(&st))
			require.Equal(t, "pending", st)
		})
	}
}

// A delivery of a job whose pause a resume is deleting does not wait for
// the resume to commit (the worker's whole ledger loop would wait with it,
// for the resume's Redis call): the job is not held, and the delivery,
// busy, is looked at again.
func TestAHoldDoesNotWaitForAResume(t *testing.T) {
	pool, _ := testenv.PrivatePool(t)
	ctx := context.Background()
	_, err := pool.Exec(ctx, `INSERT INTO keel_jobs (id, kind, business_key, queue, payload, max_retry, status, published_at, run_at)
		VALUES ('j1', 'mail', 'k1', 'default', '\x7b7d', 3, 'pending', now(), now()),
		       ('j2', 'sms', 'k2', 'low', '\x7b7d', 3, 'pending', now(), now())`)
	require.NoError(t, err)
	_, err = ledger.PauseKind(ctx, pool, "mail", "ops", "")
	require.NoError(t, err)
	_, err = ledger.PauseQueue(ctx, pool, "low", "ops", "")
	require.NoError(t, err)

	resume, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer resume.Rollback(ctx) //nolint:errcheck
	_, err = ledger.ResumeKind(ctx, resume, "mail", "ops", "")
	require.NoError(t, err)
	_, err = ledger.ResumeQueue(ctx, resume, "low", "ops", "")
	require.NoError(t, err)

	conn, err := pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	// A wait for the resume's locks ends in an error, not a hung test.
	_, err = conn.Exec(ctx, `SET lock_timeout = '5s'`)
	require.NoError(t, err)
	var why []ledger.Unclaimed
	require.NoError(t, ledger.ReadUnclaimed(ctx, conn, []string{"j1", "j2"}, func(u ledger.Unclaimed) { why = append(why, u) }))
	require.Len(t, why, 2)
	for _, u := range why {
		require.Equal(t, ledger.StatusPending, u.Status, "job %s held though its pause is being resumed", u.ID)
	}
	_, err = conn.Exec(ctx, `RESET lock_timeout`)
	require.NoError(t, err)
}
