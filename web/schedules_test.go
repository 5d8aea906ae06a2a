package web_test

import (
	"context"
	"net/http"
	"net/url"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/inspect"
	"github.com/keeljobs/keel/internal/ledger"
	"github.com/keeljobs/keel/scheduler"
	"github.com/keeljobs/keel/tasks"
)

// scheduleWithTick adds run-time entry name and gives it a tick that made
// a job, as a scheduler would; it returns the job's id.
func (b *bundle) scheduleWithTick(t *testing.T, name string) string {
	t.Helper()
	ctx := context.Background()
	require.NoError(t, b.ops.AddSchedule(ctx, inspect.ScheduleEntry{Name: name, Spec: "@every 1m", Kind: "order:send_receipt"}, "ops:ann", "hourly receipts"))
	tick := time.Now().Truncate(time.Minute).Add(time.Minute) // the first after the entry was added
	res, err := b.client.Enqueue(ctx, tasks.NewRaw("order:send_receipt", []byte(`{}`), scheduler.TickKey(name, tick)))
	require.NoError(t, err)
	require.NoError(t, ledger.MarkTick(ctx, b.pool, name, tick))
	return res.Job.ID
}

// /schedules lists the entries with their ticks' jobs; only an operator,
// with the form's token, pauses and resumes one, audited.
func TestSchedulesPage(t *testing.T) {
	b := setup(t, nil)
	jobID := b.scheduleWithTick(t, "receipts/eu")

	viewer := b.signIn(t, viewerName, viewerPassword)
	res := viewer.get(t, "/schedules")
	require.Equal(t, http.StatusOK, res.status)
	require.Contains(t, res.body, `data-entry="receipts/eu"`)
	require.Contains(t, res.body, `href="/jobs/`+jobID+`"`)
	require.Contains(t, res.body, `href="/schedules" class="on"`)
	require.Contains(t, res.body, "no scheduler runs it yet", "no scheduler has said it runs the entry")
	require.NotContains(t, res.body, `action="/schedules/pause"`, "a viewer has no buttons")
	require.Equal(t, http.StatusForbidden, viewer.post(t, "/schedules/pause", url.Values{"csrf": {viewer.token(t)}, "entry": {"receipts/eu"}}).status)

	op := b.signIn(t, operatorName, operatorPassword)
	res = op.post(t, "/schedules/pause", url.Values{"entry": {"receipts/eu"}})
	require.Equal(t, http.StatusForbidden, res.status, "no form token")
	tok := op.token(t)
	res = op.post(t, "/schedules/pause", url.Values{"csrf": {tok}, "entry": {"receipts/eu"}, "note": {"freeze"}})
	require.Equal(t, http.StatusSeeOther, res.status, res.body)
	require.Equal(t, "/schedules?done=paused", res.header.Get("Location"))
	s, err := b.ops.Schedule(context.Background(), "receipts/eu")
	require.NoError(t, err)
	require.Equal(t, operatorName, s.Paused.PausedBy)
	require.Equal(t, "freeze", s.Paused.Note)
	res = op.get(t, "/schedules?done=paused")
	require.Contains(t, res.body, "Paused: no scheduler enqueues")
	require.Contains(t, res.body, `action="/schedules/resume"`)

	res = op.post(t, "/schedules/resume", url.Values{"csrf": {tok}, "entry": {"receipts/eu"}})
	require.Equal(t, http.StatusSeeOther, res.status, res.body)
	res = op.post(t, "/schedules/resume", url.Values{"csrf": {tok}, "entry": {"receipts/eu"}})
	require.Equal(t, "/schedules?done=already-resumed", res.header.Get("Location"))
	res = op.post(t, "/schedules/pause", url.Values{"csrf": {tok}, "entry": {"no-such"}})
	require.Equal(t, http.StatusNotFound, res.status)

	var audited int
	require.NoError(t, b.pool.QueryRow(context.Background(),
		`SELECT count(*) FROM keel_audit WHERE action IN ('pause-schedule:receipts/eu', 'resume-schedule:receipts/eu') AND actor = $1`, operatorName).Scan(&audited))
	require.Equal(t, 2, audited)
}

// In a browser: the nav leads to the schedules, a tick's job opens, and
// an operator pauses and resumes an entry with the page's buttons.
func TestBrowserSchedules(t *testing.T) {
	needChromium(t)
	b := setupAlone(t, nil)
	jobID := b.scheduleWithTick(t, "receipts:nightly")
	ctx := newBrowser(t)
	base := b.ts.URL
	signInBrowser(t, ctx, base, operatorName, operatorPassword, "/")
	run(t, ctx, chromedp.WaitVisible(chromedp.CSS(`a[href="/schedules"]`)), chromedp.Click(chromedp.CSS(`a[href="/schedules"]`)), chromedp.WaitVisible(chromedp.ID("schedules")))
	row := `#schedules tr[data-entry="receipts:nightly"]`
	require.Equal(t, "no", text(t, ctx, row+" .pause-state"))
	require.NotEqual(t, "—", text(t, ctx, row+" .next-tick"))
	noCSPViolations(t, ctx, "the schedules page")
	noPageOverflow(t, ctx, "the schedules page")
	screenshot(t, ctx, t.TempDir(), "schedules.png")

	run(t, ctx,
		chromedp.SendKeys(chromedp.CSS(row+` input[name="note"]`), "month-end freeze"),
		chromedp.Click(chromedp.CSS(row+` button`)),
	)
	waitJS(t, ctx, `document.location.search === '?done=paused'`, "the pause did not come back to the page")
	require.Contains(t, text(t, ctx, row+" .pause-state"), "by "+operatorName)
	require.Contains(t, text(t, ctx, row+" .pause-state"), "month-end freeze")
	require.Equal(t, "—", text(t, ctx, row+" .next-tick"))
	require.Equal(t, "Resume", text(t, ctx, row+" button"))
	s, err := b.ops.Schedule(context.Background(), "receipts:nightly")
	require.NoError(t, err)
	require.NotNil(t, s.Paused)

	run(t, ctx, chromedp.Click(chromedp.CSS(row+` button`)))
	waitJS(t, ctx, `document.location.search === '?done=resumed'`, "the resume did not come back to the page")
	require.Equal(t, "no", text(t, ctx, row+" .pause-state"))

	run(t, ctx, chromedp.Click(chromedp.CSS(row+` a.tick-job`)))
	waitJS(t, ctx, `document.location.pathname === '/jobs/`+jobID+`'`, "the tick's job did not open")
}
