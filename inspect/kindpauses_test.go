package inspect_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/inspect"
)

// A kind's pause holds its pending and failed jobs, not its running or
// dead ones nor another kind's; a held job can be cancelled, and the
// resume makes the others pending again. Who and a valid kind are required.
func TestPauseKind(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	ids := map[string]string{}
	for _, shape := range []string{"pending", "failed", "running", "dead"} {
		ids[shape] = b.put(t, "kp:mail", shape)
	}
	other := b.put(t, "kp:sms", "pending")
	cancelMe := b.put(t, "kp:mail", "pending")

	_, err := b.ops.PauseKind(ctx, "kp:mail", " ", "")
	require.ErrorIs(t, err, inspect.ErrActorRequired)
	_, err = b.ops.PauseKind(ctx, "", "ops", "")
	require.ErrorIs(t, err, inspect.ErrInvalidName)

	changed, err := b.ops.PauseKind(ctx, "kp:mail", "ops", "mail server down")
	require.NoError(t, err)
	require.True(t, changed)
	require.Equal(t, idempotency.StatusPaused, b.status(t, ids["pending"]))
	require.Equal(t, idempotency.StatusPaused, b.status(t, ids["failed"]))
	require.Equal(t, idempotency.StatusRunning, b.status(t, ids["running"]))
	require.Equal(t, idempotency.StatusDead, b.status(t, ids["dead"]))
	require.Equal(t, idempotency.StatusPending, b.status(t, other))
	kinds, err := b.ops.PausedKinds(ctx)
	require.NoError(t, err)
	require.Len(t, kinds, 1)
	require.Equal(t, int64(3), kinds[0].Held)

	_, err = b.ops.Cancel(ctx, cancelMe, "ops", "not needed")
	require.NoError(t, err)
	require.Equal(t, idempotency.StatusCancelled, b.status(t, cancelMe))

	changed, err = b.ops.ResumeKind(ctx, "kp:mail", "ops", "back")
	require.NoError(t, err)
	require.True(t, changed)
	require.Equal(t, idempotency.StatusPending, b.status(t, ids["pending"]))
	require.Equal(t, idempotency.StatusPending, b.status(t, ids["failed"]))
	require.Equal(t, idempotency.StatusCancelled, b.status(t, cancelMe))
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM keel_jobs WHERE id = $1 AND published_at IS NULL`, ids["failed"]))
	changed, err = b.ops.ResumeKind(ctx, "kp:mail", "ops", "again")
	require.NoError(t, err)
	require.False(t, changed)
	kinds, err = b.ops.PausedKinds(ctx)
	require.NoError(t, err)
	require.Empty(t, kinds)
}
