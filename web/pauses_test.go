package web_test

import (
	"context"
	"net/http"
	"net/url"
	"testing"

	"github.com/chromedp/chromedp"
	"github.com/hibiken/asynq"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/ledger"
)

// The Pauses page pauses and resumes queues and kinds for operators, with
// the form token, audited under the operator's name; a viewer sees the
// pauses and no form, and cannot post one.
func TestPausesPage(t *testing.T) {
	b := setup(t, nil)
	ctx := context.Background()
	op := b.signIn(t, operatorName, operatorPassword)
	j := b.waitingJob(t, "order:1")

	res := op.get(t, "/pauses")
	require.Equal(t, http.StatusOK, res.status)
	require.Contains(t, res.body, `id="no-paused-kinds"`)
	require.Contains(t, res.body, `id="pause-form"`)

	form := url.Values{"what": {"kind"}, "name": {"order:send_receipt"}, "action": {"pause"}, "note": {"mail server down"}}
	res = op.post(t, "/pauses", form)
	require.Equal(t, http.StatusForbidden, res.status, "no form token")
	require.Equal(t, idempotency.StatusPending, b.status(t, j.ID))
	form.Set("csrf", op.token(t))
	res = op.post(t, "/pauses", form)
	require.Equal(t, http.StatusSeeOther, res.status, res.body)
	require.Equal(t, "/pauses?done=paused-kind", res.header.Get("Location"))
	require.Equal(t, idempotency.StatusPaused, b.status(t, j.ID))
	kinds, err := ledger.KindPauses(ctx, b.pool)
	require.NoError(t, err)
	require.Len(t, kinds, 1)
	require.Equal(t, operatorName, kinds[0].PausedBy)
	require.Equal(t, "mail server down", kinds[0].Note)
	res = op.get(t, "/jobs/"+j.ID)
	require.Contains(t, res.body, "its kind order:send_receipt is paused")

	queue := url.Values{"csrf": {op.token(t)}, "what": {"queue"}, "name": {"low"}, "action": {"pause"}}
	res = op.post(t, "/pauses", queue)
	require.Equal(t, http.StatusSeeOther, res.status, res.body)
	insp := asynq.NewInspector(b.redis)
	defer insp.Close()
	paused, err := ledger.Pauses(ctx, b.pool)
	require.NoError(t, err)
	require.Len(t, paused, 1)
	require.Equal(t, "low", paused[0].Queue)

	res = op.post(t, "/pauses", url.Values{"csrf": {op.token(t)}, "what": {"queue"}, "name": {"no such queue!"}, "action": {"pause"}})
	require.Equal(t, http.StatusBadRequest, res.status)
	require.Contains(t, res.body, "invalid name")

	v := b.signIn(t, viewerName, viewerPassword)
	res = v.get(t, "/pauses")
	require.Equal(t, http.StatusOK, res.status)
	require.Contains(t, res.body, "mail server down")
	require.NotContains(t, res.body, `id="pause-form"`)
	require.NotContains(t, res.body, `resume-kind`)
	res = v.post(t, "/pauses", url.Values{"csrf": {v.token(t)}, "what": {"kind"}, "name": {"order:send_receipt"}, "action": {"resume"}})
	require.Equal(t, http.StatusForbidden, res.status)
	require.Equal(t, idempotency.StatusPaused, b.status(t, j.ID))

	// Its queue paused too: the page names both pauses.
	res = op.post(t, "/pauses", url.Values{"csrf": {op.token(t)}, "what": {"queue"}, "name": {"default"}, "action": {"pause"}})
	require.Equal(t, http.StatusSeeOther, res.status, res.body)
	res = op.get(t, "/jobs/"+j.ID)
	require.Contains(t, res.body, "its kind order:send_receipt and its queue default are paused")

	res = op.post(t, "/pauses", url.Values{"csrf": {op.token(t)}, "what": {"kind"}, "name": {"order:send_receipt"}, "action": {"resume"}})
	require.Equal(t, http.StatusSeeOther, res.status, res.body)
	require.Equal(t, idempotency.StatusPending, b.status(t, j.ID))
	// Held by its queue alone, as a claim holds a job Redis delivered
	// without the queue's pause: the queue's resume releases it.
	_, err = b.pool.Exec(ctx, `UPDATE keel_jobs SET status = 'paused' WHERE id = $1`, j.ID)
	require.NoError(t, err)
	res = op.get(t, "/jobs/"+j.ID)
	require.Contains(t, res.body, "its queue default is paused (see Pauses), and Redis")
	res = op.get(t, "/pauses")
	require.Regexp(t, `id="queue-default">\s*<td><code>default</code></td><td class="held">1</td>`, res.body)
	res = op.post(t, "/pauses", url.Values{"csrf": {op.token(t)}, "what": {"queue"}, "name": {"default"}, "action": {"resume"}})
	require.Equal(t, http.StatusSeeOther, res.status, res.body)
	require.Equal(t, idempotency.StatusPending, b.status(t, j.ID))
	res = op.post(t, "/pauses", url.Values{"csrf": {op.token(t)}, "what": {"queue"}, "name": {"low"}, "action": {"resume"}})
	require.Equal(t, http.StatusSeeOther, res.status, res.body)
	paused, err = ledger.Pauses(ctx, b.pool)
	require.NoError(t, err)
	require.Empty(t, paused)
}

// An operator pauses a kind and resumes it with the page's buttons in a
// real browser; the job list shows the held job as paused meanwhile.
func TestBrowserPauses(t *testing.T) {
	needChromium(t)
	b := setupAlone(t, nil)
	j := b.waitingJob(t, "order:7")
	ctx := newBrowser(t)
	signInBrowser(t, ctx, b.ts.URL, operatorName, operatorPassword, "/pauses")
	run(t, ctx,
		chromedp.WaitVisible(chromedp.ID("pause-form")),
		chromedp.SetValue(chromedp.ID("pause-what"), "kind"),
		chromedp.SendKeys(chromedp.ID("pause-name"), "order:send_receipt"),
		chromedp.SendKeys(chromedp.ID("pause-note"), "mail server down"),
		chromedp.Click(chromedp.ID("pause")),
		chromedp.WaitVisible(chromedp.ID("paused-kinds")),
	)
	require.Contains(t, text(t, ctx, ".flash"), "Paused")
	require.Equal(t, "1", text(t, ctx, "#paused-kinds td.held"))
	noCSPViolations(t, ctx, "/pauses")
	require.Equal(t, idempotency.StatusPaused, b.status(t, j.ID))

	run(t, ctx, chromedp.Navigate(b.ts.URL+"/jobs?status=paused"))
	waitJS(t, ctx, `document.body.innerText.includes("order:7")`, "the held job is not listed as paused")

	run(t, ctx,
		chromedp.Navigate(b.ts.URL+"/pauses"),
		chromedp.WaitVisible(chromedp.CSS("button.resume-kind")),
		chromedp.Click(chromedp.CSS("button.resume-kind")),
		chromedp.WaitVisible(chromedp.ID("no-paused-kinds")),
	)
	require.Contains(t, text(t, ctx, ".flash"), "Resumed")
	require.Equal(t, idempotency.StatusPending, b.status(t, j.ID))
	noCSPViolations(t, ctx, "/pauses")
}
