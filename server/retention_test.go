package server_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/ledger"
	"github.com/keeljobs/keel/tasks"
)

type receipt struct {
	ID string `json:"id"`
}

var keptReceipt = tasks.Define[receipt]("server:kept_receipt", tasks.Key(func(r receipt) string { return r.ID }),
	tasks.Keep("succeeded", 7*24*time.Hour), tasks.Keep("dead", 90*24*time.Hour), tasks.KeepDeadAtMost(1000))

// A worker records its kinds' retention as they are declared in code by
// the time it runs a job: what an earlier build declared and this one
// does not goes, and a person's policy is left as it is.
func TestWorkerRecordsItsKindsRetention(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	kind := keptReceipt.Name()
	require.NoError(t, ledger.DeclareRetention(ctx, b.pool, kind, []ledger.Policy{{Status: "cancelled", Keep: 48 * time.Hour}}, "older build"))
	require.NoError(t, ledger.SetRetention(ctx, b.pool, ledger.Policy{Kind: kind, Status: "succeeded", Keep: 3 * 24 * time.Hour},
		"ops", "a person's", nil))
	mux := tasks.NewMux()
	tasks.Handle(mux, keptReceipt, func(context.Context, receipt) error { return nil })
	res, err := b.client.Enqueue(ctx, keptReceipt.New(receipt{ID: "r1"}))
	require.NoError(t, err)
	b.startWorker(t, mux, nil)
	b.waitStatus(t, res.Job.ID, idempotency.StatusSucceeded, 20*time.Second)

	ps, err := ledger.Retention(ctx, b.pool)
	require.NoError(t, err)
	type row struct {
		Status, Source string
		Keep           time.Duration
		MaxCount       int64
	}
	var got []row
	for _, p := range ps {
		got = append(got, row{p.Status, p.Source, p.Keep, p.MaxCount})
	}
	day := 24 * time.Hour
	require.Equal(t, []row{
		{"dead", "code", 90 * day, 1000},
		{"succeeded", "person", 3 * day, 0},
		{"succeeded", "code", 7 * day, 0},
	}, got)
	p, ok := ledger.InForce(ps, kind, "succeeded")
	require.True(t, ok)
	require.Equal(t, 3*day, p.Keep, "the person's")
}
