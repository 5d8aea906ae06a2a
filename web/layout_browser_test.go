package web_test

import (
	"context"
	"fmt"
	"net/url"
	"os"
	"strings"
	"testing"

	"github.com/chromedp/chromedp"
	"github.com/hibiken/asynq"
	"github.com/stretchr/testify/require"
)

// noPageOverflow fails when the page itself scrolls sideways (a table may
// scroll inside its card) or a card's content spills out of it.
func noPageOverflow(t *testing.T, ctx context.Context, where string) {
	t.Helper()
	require.LessOrEqual(t, eval[int](t, ctx, `document.documentElement.scrollWidth`), eval[int](t, ctx, `window.innerWidth`),
		"%s scrolls sideways", where)
	spilled := eval[[]string](t, ctx, `[...document.querySelectorAll('.card dd, .card td, .card pre, .card p')].filter(e => {
		const card = e.closest('.card').getBoundingClientRect(), r = e.getBoundingClientRect();
		return e.closest('table') === null && r.right > card.right + 1;
	}).map(e => e.tagName + ': ' + e.innerText.slice(0, 40))`)
	require.Empty(t, spilled, "%s: content wider than its card", where)
}

// TestBrowserLayout looks at keel's pages as an operator scans them, at a
// laptop's 1366 px and at a phone's 390 px, and at what asynqmon's wrapper
// adds to its app.
func TestBrowserLayout(t *testing.T) {
	needChromium(t)
	b := setupAlone(t, nil)
	shots := t.TempDir()
	if dir := os.Getenv("KEEL_WEB_SCREENSHOT_DIR"); dir != "" {
		shots = dir
	}
	for i := range 16 {
		b.deadJob(t, "order:send_receipt", fmt.Sprintf("order:ord_01JD8Z%020d", i),
			"sending the receipt failed: smtp: 550 5.1.1 mailbox unavailable for recipient at mx.example.com (attempt 3); the provider says the address does not exist")
	}
	note := strings.Repeat("refund-requested-by-customer-", 40)
	closed := b.deadJob(t, "order:send_receipt", "order:closed", "boom")
	_, err := b.ops.Discard(t.Context(), closed.ID, operatorName, note)
	require.NoError(t, err)
	c := asynq.NewClient(b.redis)
	defer c.Close()
	for range 25 { // more than fill a screen: the list reaches every corner
		_, err = c.Enqueue(asynq.NewTask("report:daily", []byte(`{}`)), asynq.Queue("reports.v2"))
		require.NoError(t, err)
	}

	ctx := newBrowser(t)
	base := b.ts.URL
	signInBrowser(t, ctx, base, operatorName, operatorPassword, "/")
	run(t, ctx, chromedp.WaitVisible(chromedp.ID("dead-total")))
	host := strings.TrimPrefix(base, "http://")

	// No open redirect: signed in, the sign-in page sends the browser on,
	// and it stays here.
	for _, next := range []string{`/./\evil.example`, `/../\evil.example`, `/x/../\evil.example`} {
		run(t, ctx, chromedp.Navigate(base+"/login?next="+url.QueryEscape(next)))
		waitJS(t, ctx, `document.readyState === 'complete' && !!document.querySelector('#dead-total')`, "the redirect did not land on the overview")
		require.Equal(t, host, eval[string](t, ctx, `location.host`), next)
	}

	for _, width := range []int{1366, 390} {
		run(t, ctx, chromedp.EmulateViewport(int64(width), 900))
		name := func(page string) string { return fmt.Sprintf("%s-%d.png", page, width) }

		// The jobs list: the job reads whole, the last error takes what is left.
		run(t, ctx, chromedp.Navigate(base+"/jobs?status=dead"), chromedp.WaitVisible(chromedp.ID("jobs")))
		noPageOverflow(t, ctx, "the jobs list")
		if width == 1366 {
			require.Equal(t, 0, eval[int](t, ctx, `[...document.querySelectorAll('#jobs td.job bdi')].filter(e => e.getClientRects().length !== 1).length`),
				"a kind or business key breaks across lines")
			require.GreaterOrEqual(t, eval[float64](t, ctx, `document.querySelector('#jobs th.job').getBoundingClientRect().width`), 300.0)
		}
		screenshot(t, ctx, shots, name("jobs"))

		// Dead letters: a dense table, a row opens for the details.
		run(t, ctx, chromedp.Navigate(base+"/dead"), chromedp.WaitVisible(chromedp.ID("dead")))
		screenshot(t, ctx, shots, name("dead"))
		noPageOverflow(t, ctx, "the dead letters")
		require.Equal(t, 16, eval[int](t, ctx, `document.querySelectorAll('#dead tr.dead-row').length`))
		if width == 1366 {
			require.Less(t, eval[int](t, ctx, `document.documentElement.scrollHeight`), 1600, "16 dead letters should fit in a page or two")
			require.Equal(t, 0, eval[int](t, ctx, `[...document.querySelectorAll('#dead td.job bdi')].filter(e => e.getClientRects().length !== 1).length`))
		}
		require.NotContains(t, eval[string](t, ctx, `document.querySelector('#dead').innerText`), "Trace id\t—")
		row := fmt.Sprintf("#dead tr.dead-row:nth-child(%d)", 2)
		run(t, ctx, chromedp.Click(chromedp.CSS(row+" summary")), chromedp.WaitVisible(chromedp.CSS(row+" pre.err")))
		require.Contains(t, text(t, ctx, row+" pre.err"), "mailbox unavailable")
		noPageOverflow(t, ctx, "an open dead letter")
		screenshot(t, ctx, shots, name("dead-open"))

		// A long unbroken note stays inside its card.
		run(t, ctx, chromedp.Navigate(base+"/jobs/"+closed.ID), chromedp.WaitVisible(chromedp.CSS("table.audit")))
		noPageOverflow(t, ctx, "a job with a long note")
		require.Equal(t, 0, eval[int](t, ctx, `[...document.querySelectorAll('.card')].filter(c => c.scrollWidth > c.clientWidth + 1).length`),
			"a card scrolls sideways")
		screenshot(t, ctx, shots, name("job"))

		// The overview's charts are wide enough to read, with a time axis.
		run(t, ctx, chromedp.Navigate(base+"/"), chromedp.WaitVisible(chromedp.ID("dead-total")))
		// Two samples draw a chart: reload until the sampler has taken them.
		waitJS(t, ctx, `!!document.querySelector('svg.chart text.tick-label') || (location.reload(), false)`,
			"the overview's charts never drew")
		noPageOverflow(t, ctx, "the overview")
		labels := eval[[]string](t, ctx, `[...document.querySelector('svg.chart').querySelectorAll('text.tick-label')].map(e => e.textContent)`)
		require.Len(t, labels, 5)
		require.Equal(t, "now", labels[4])
		chartWidth := eval[float64](t, ctx, `document.querySelector('svg.chart').getBoundingClientRect().width`)
		if width == 1366 {
			require.GreaterOrEqual(t, chartWidth, 500.0)
		} else {
			require.GreaterOrEqual(t, chartWidth, 300.0)
		}
		screenshot(t, ctx, shots, name("overview"))

		// asynqmon's queue page, a queue name with a dot: keel's wrapper, and
		// its button covers none of the app's columns or controls.
		run(t, ctx, chromedp.Navigate(base+"/monitoring/queues/reports.v2?status=pending"))
		waitJS(t, ctx, `(() => { const r = document.querySelector('#root'); return !!r && !!document.querySelector('#keel-back') &&
			r.innerText.includes('report:daily') })()`, "asynqmon's queue page did not render its tasks")
		covered := eval[[]string](t, ctx, `(() => {
			const k = document.querySelector('#keel-back').getBoundingClientRect();
			return [...document.querySelectorAll('#root td, #root th, #root button, #root a, #root input, #root h6, #root p, #root img, #root svg')].filter(e => {
				const r = e.getBoundingClientRect();
				return r.width > 0 && r.height > 0 && r.left < k.right && r.right > k.left && r.top < k.bottom && r.bottom > k.top;
			}).map(e => e.tagName + ': ' + (e.innerText || e.textContent || '').slice(0, 30));
		})()`)
		require.Empty(t, covered, "the keel button covers asynqmon at %d px", width)
		screenshot(t, ctx, shots, name("monitoring"))
	}
}
