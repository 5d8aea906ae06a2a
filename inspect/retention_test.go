package inspect_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/inspect"
	"github.com/keeljobs/keel/internal/ledger"
)

// A person's retention policy is recorded with who and why, and every
// change (set, changed, unset) leaves its row in the audit log.
func TestRetentionChangesAreAudited(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	kind := "retention:" + t.Name()
	day := 24 * time.Hour
	require.NoError(t, b.ops.SetRetention(ctx, inspect.RetentionPolicy{Kind: kind, Status: "succeeded", Keep: 7 * day}, "alice", "ledger at 80%"))
	require.NoError(t, b.ops.SetRetention(ctx, inspect.RetentionPolicy{Kind: kind, Status: "dead", Keep: 90 * day, MaxCount: 1000},
		"alice", "bounded"))
	require.NoError(t, b.ops.SetRetention(ctx, inspect.RetentionPolicy{Kind: kind, Status: "succeeded", Keep: 3 * day}, "bob", "shorter"))
	ps, err := b.ops.Retention(ctx)
	require.NoError(t, err)
	p, ok := inspect.RetentionInForce(ps, kind, "succeeded")
	require.True(t, ok)
	require.Equal(t, []any{3 * day, "bob", "shorter", inspect.SourcePerson}, []any{p.Keep, p.SetBy, p.Note, p.Source})
	p, ok = inspect.RetentionInForce(ps, kind, "dead")
	require.True(t, ok)
	require.Equal(t, []any{90 * day, int64(1000)}, []any{p.Keep, p.MaxCount})

	changed, err := b.ops.UnsetRetention(ctx, kind, "succeeded", "carol", "back to the default")
	require.NoError(t, err)
	require.True(t, changed)
	changed, err = b.ops.UnsetRetention(ctx, kind, "succeeded", "carol", "again")
	require.NoError(t, err)
	require.False(t, changed, "nothing to unset, nothing audited")

	audit, err := b.ops.Audit(ctx, "")
	require.NoError(t, err)
	var got [][3]string
	for _, a := range audit {
		if strings.HasPrefix(a.Action, "retention-") && strings.Contains(a.Action, kind) {
			got = append(got, [3]string{a.Action, a.Actor, a.Note})
		}
	}
	require.Equal(t, [][3]string{
		{"retention-set:" + kind + "/succeeded keep_ms=604800000 max_count=none", "alice", "ledger at 80%"},
		{"retention-set:" + kind + "/dead keep_ms=7776000000 max_count=1000", "alice", "bounded"},
		{"retention-set:" + kind + "/succeeded keep_ms=259200000 max_count=none", "bob", "shorter"},
		{"retention-unset:" + kind + "/succeeded", "carol", "back to the default"},
	}, got)
}

// What a policy cannot say is refused before anything is written.
func TestRetentionRefusesWhatCannotWork(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	for name, p := range map[string]inspect.RetentionPolicy{
		"no kind":                       {Status: "succeeded", Keep: 48 * time.Hour},
		"an open status":                {Kind: "k", Status: "pending", Keep: 48 * time.Hour},
		"shorter than the dedupe floor": {Kind: "k", Status: "succeeded", Keep: time.Minute},
		"a count on succeeded jobs":     {Kind: "k", Status: "succeeded", MaxCount: 10},
	} {
		require.Error(t, b.ops.SetRetention(ctx, p, "alice", ""), name)
	}
	require.ErrorIs(t, b.ops.SetRetention(ctx, inspect.RetentionPolicy{Kind: "k", Status: "dead", MaxCount: 1}, "", ""),
		inspect.ErrActorRequired)
	require.Equal(t, ledger.MinKeep, inspect.MinRetention)
}

// MarkSeen counts a dead letter once per death, and nothing else.
func TestMarkSeenCountsDeadLettersOnce(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	dead, ok := b.put(t, "seen:"+t.Name(), "dead"), b.put(t, "seen:"+t.Name(), "succeeded")
	n, err := b.ops.MarkSeen(ctx, []string{dead, ok}, "alice")
	require.NoError(t, err)
	require.Equal(t, 1, n)
	n, err = b.ops.MarkSeen(ctx, []string{dead}, "bob")
	require.NoError(t, err)
	require.Zero(t, n, "seen already since it died")
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM keel_jobs WHERE id = $1 AND seen_by = 'alice' AND seen_at >= finished_at`, dead))
}
