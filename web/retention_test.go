package web_test

import (
	"context"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/internal/ledger"
)

// The retention page shows, to any signed-in person, the policy in force
// per kind and status and the code's it overrides; nobody changes it here.
func TestRetentionPage(t *testing.T) {
	b := setup(t, nil)
	ctx := context.Background()
	require.NoError(t, ledger.DeclareRetention(ctx, b.pool, "order:send_receipt", []ledger.Policy{{Status: "succeeded", Keep: 48 * time.Hour}}, "w"))
	require.NoError(t, ledger.SetRetention(ctx, b.pool, ledger.Policy{Kind: "order:send_receipt", Status: "succeeded", Keep: 7 * 24 * time.Hour},
		"ops:ann", "ledger at <80%>", nil))
	require.NoError(t, ledger.SetRetention(ctx, b.pool, ledger.Policy{Kind: "order:send_receipt", Status: "dead", MaxCount: 500},
		"ops:ann", "", nil))

	v := b.signIn(t, viewerName, viewerPassword)
	res := v.get(t, "/retention")
	require.Equal(t, http.StatusOK, res.status, res.body)
	require.Contains(t, res.body, `<a href="/retention" class="on">Retention</a>`)
	require.Regexp(t, `id="policy-order:send_receipt-succeeded-person">[\s\S]*?kept 7 days[\s\S]*?ops:ann[\s\S]*?ledger at &lt;80%&gt;`, res.body)
	require.Regexp(t, `id="policy-order:send_receipt-succeeded-code" class="muted">[\s\S]*?\(overridden\) kept 2 days[\s\S]*?the kind's code`, res.body)
	require.Regexp(t, `id="policy-order:send_receipt-dead-person">[\s\S]*?kept for ever, at most 500 \(the oldest seen go\)`, res.body)
	require.NotContains(t, res.body[strings.Index(res.body, "<main>"):], "<form", "read-only")
	require.Equal(t, http.StatusFound, b.anonymous().get(t, "/retention").status, "signing in is required")
	require.Equal(t, http.StatusMethodNotAllowed, v.do(t, http.MethodPost, "/retention", nil, nil).status)
}

// A dead letter's page records who saw it, once per death; other jobs'
// pages record nothing.
func TestJobPageMarksDeadLetterSeen(t *testing.T) {
	b := setup(t, nil)
	ctx := context.Background()
	dead := b.deadJob(t, "order:send_receipt", "order:seen", "boom")
	v := b.signIn(t, viewerName, viewerPassword)
	seenBy := func(id string) string {
		var by *string
		require.NoError(t, b.pool.QueryRow(ctx, `SELECT CASE WHEN seen_at >= finished_at THEN seen_by END FROM keel_jobs WHERE id = $1`, id).Scan(&by))
		if by == nil {
			return ""
		}
		return *by
	}
	require.Equal(t, "", seenBy(dead.ID))
	res := v.get(t, "/jobs/"+dead.ID)
	require.Equal(t, http.StatusOK, res.status, res.body)
	require.Equal(t, viewerName, seenBy(dead.ID))
	op := b.signIn(t, operatorName, operatorPassword)
	op.get(t, "/jobs/"+dead.ID)
	require.Equal(t, viewerName, seenBy(dead.ID), "the first sighting since it died is kept")

	pending := b.waitingJob(t, "order:unseen")
	v.get(t, "/jobs/"+pending.ID)
	var n int
	require.NoError(t, b.pool.QueryRow(ctx, `SELECT count(*) FROM keel_jobs WHERE id = $1 AND seen_at IS NOT NULL`, pending.ID).Scan(&n))
	require.Zero(t, n)
}

func TestBrowserRetentionPage(t *testing.T) {
	needChromium(t)
	b := setupAlone(t, nil)
	require.NoError(t, ledger.SetRetention(context.Background(), b.pool, ledger.Policy{Kind: "order:send_receipt", Status: "dead",
		Keep: 90 * 24 * time.Hour, MaxCount: 1000}, "ops:ann", "sized from the capacity model", nil))

	ctx := newBrowser(t)
	signInBrowser(t, ctx, b.ts.URL, viewerName, viewerPassword, "/")
	run(t, ctx, chromedp.Click(chromedp.CSS(`nav a[href="/retention"]`)), chromedp.WaitVisible(chromedp.ID("retention")))
	require.Equal(t, 1, eval[int](t, ctx, `document.querySelectorAll('#retention tbody tr').length`))
	require.True(t, strings.HasPrefix(text(t, ctx, "#retention .policy"), "kept 90 days, at most 1000"))
	screenshot(t, ctx, t.TempDir(), "retention.png")
	noCSPViolations(t, ctx, "the retention page")
}
