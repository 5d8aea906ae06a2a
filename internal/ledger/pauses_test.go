package ledger_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/internal/ledger"
)

// A pause is recorded once and audited once; a resume likewise.
func TestPauses(t *testing.T) {
	ctx := context.Background()
	tx, err := big.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx)                                                               //nolint:errcheck
	p := plan(t, func(db ledger.DB) { ledger.PauseQueue(ctx, db, "low", "ops", "why") }) //nolint:errcheck
	usesIndex(t, p, nil)
	p = plan(t, func(db ledger.DB) { ledger.ResumeQueue(ctx, db, "low", "ops", "why") }) //nolint:errcheck
	usesIndex(t, p, nil)

	done, err := ledger.PauseQueue(ctx, tx, "low", "ops:ann", "the warehouse is closed")
	require.NoError(t, err)
	require.True(t, done)
	done, err = ledger.PauseQueue(ctx, tx, "low", "ops:bo", "again")
	require.NoError(t, err)
	require.False(t, done)
	_, err = tx.Exec(ctx, `INSERT INTO keel_jobs (id, kind, business_key, queue, payload, max_retry, status, published_at, run_at)
		VALUES ('held-1', 'mail', 'k1', 'low', '\x7b7d', 3, 'pending', now(), now()),
		       ('held-2', 'mail', 'k2', 'low', '\x7b7d', 3, 'pending', now(), now()),
		       ('elsewhere', 'mail', 'k3', 'default', '\x7b7d', 3, 'paused', now(), now()),
		       ('kind-held', 'report', 'k4', 'low', '\x7b7d', 3, 'paused', now(), now())`)
	require.NoError(t, err)
	// A job whose kind is paused too is its kind's resume's to release.
	_, err = ledger.PauseKind(ctx, tx, "report", "ops:ann", "")
	require.NoError(t, err)
	var why []ledger.Unclaimed
	require.NoError(t, ledger.ReadUnclaimed(ctx, tx, []string{"held-1", "held-2"}, func(u ledger.Unclaimed) { why = append(why, u) }))
	require.Len(t, why, 2)
	for _, u := range why {
		require.Equal(t, ledger.StatusPaused, u.Status, "a delivery of a queue the ledger holds paused is held")
	}
	ps, err := ledger.Pauses(ctx, tx)
	require.NoError(t, err)
	require.Len(t, ps, 1)
	require.Equal(t, "ops:ann", ps[0].PausedBy)
	require.Equal(t, "the warehouse is closed", ps[0].Note)
	require.Equal(t, int64(2), ps[0].Held, "what the queue's resume releases")
	names, err := ledger.PausedQueues(ctx, tx)
	require.NoError(t, err)
	require.Equal(t, []string{"low"}, names)
	p = plan(t, func(db ledger.DB) { ledger.Pauses(ctx, db) }) //nolint:errcheck
	usesIndex(t, p, []string{"keel_jobs_paused"}, "keel_jobs")
	p = plan(t, func(db ledger.DB) { ledger.ReleaseQueue(ctx, db, "low") }) //nolint:errcheck
	usesIndex(t, p, []string{"keel_jobs_paused"}, "keel_jobs")
	toApply, err := ledger.PausesToApply(ctx, tx)
	require.NoError(t, err)
	require.Equal(t, []ledger.Pause{{Queue: "low", PausedAt: ps[0].PausedAt, PausedBy: "ops:ann", Note: "the warehouse is closed"}}, toApply)
	done, err = ledger.ResumeQueue(ctx, tx, "low", "ops:bo", "open again")
	require.NoError(t, err)
	require.True(t, done)
	n, err := ledger.ReleaseQueue(ctx, tx, "low")
	require.NoError(t, err)
	require.Equal(t, int64(2), n, "the held jobs of the queue, not of another, nor of a paused kind")
	var st string
	require.NoError(t, tx.QueryRow(ctx, `SELECT status FROM keel_jobs WHERE id = 'kind-held'`).Scan(&st))
	require.Equal(t, "paused", st)
	done, err = ledger.ResumeQueue(ctx, tx, "low", "ops:bo", "open again")
	require.NoError(t, err)
	require.False(t, done)
	var audited int
	require.NoError(t, tx.QueryRow(ctx, `SELECT count(*) FROM keel_audit WHERE action IN ('pause-queue:low', 'resume-queue:low')`).Scan(&audited))
	require.Equal(t, 2, audited)
}
