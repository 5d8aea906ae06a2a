package web_test

import (
	"context"
	"net/http"
	"testing"

	"github.com/hibiken/asynq"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/inspect"
	"github.com/keeljobs/keel/internal/ledger"
)

// asynqmon's pause and resume buttons are keel's: the pause is recorded in
// the ledger, audited, and Redis has it; a resume lifts both.
func TestAsynqmonPauseIsKeelsPause(t *testing.T) {
	b := setup(t, nil)
	op := b.signIn(t, operatorName, operatorPassword)
	insp := asynq.NewInspector(b.redis)
	defer insp.Close()
	b.waitingJob(t, "order:1") // the queue exists in asynq

	res := op.do(t, http.MethodPost, "/monitoring/api/queues/default:pause", nil, nil)
	require.Equal(t, http.StatusNoContent, res.status, res.body)
	info, err := insp.GetQueueInfo("default")
	require.NoError(t, err)
	require.True(t, info.Paused)
	ps, err := ledger.Pauses(context.Background(), b.pool)
	require.NoError(t, err)
	require.Len(t, ps, 1)
	require.Equal(t, "default", ps[0].Queue)
	require.Equal(t, operatorName, ps[0].PausedBy)
	require.Equal(t, "paused from asynqmon", ps[0].Note)

	// keel's own API sees the same pause.
	ops, err := inspect.New(inspect.Config{Pool: b.pool, Redis: b.redis})
	require.NoError(t, err)
	defer ops.Close()
	changed, err := ops.PauseQueue(context.Background(), "default", "ops", "again")
	require.NoError(t, err)
	require.False(t, changed, "paused already")

	res = op.do(t, http.MethodPost, "/monitoring/api/queues/default:resume", nil, nil)
	require.Equal(t, http.StatusNoContent, res.status, res.body)
	info, err = insp.GetQueueInfo("default")
	require.NoError(t, err)
	require.False(t, info.Paused)
	ps, err = ledger.Pauses(context.Background(), b.pool)
	require.NoError(t, err)
	require.Empty(t, ps)

	v := b.signIn(t, viewerName, viewerPassword)
	res = v.do(t, http.MethodPost, "/monitoring/api/queues/default:pause", nil, nil)
	require.Equal(t, http.StatusForbidden, res.status)
}
