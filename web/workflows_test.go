package web_test

import (
	"context"
	"fmt"
	"net/http"
	"net/url"
	"regexp"
	"strings"
	"testing"

	"github.com/chromedp/chromedp"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/tasks"
)

// diamond enqueues workflow id, a → b, c → d, under the task names given
// (a, b, c, d unless renamed), then moves it as workers would: a and b
// succeed, c dies. d waits for c, and c's replay is what would release it.
func (b *bundle) diamond(t *testing.T, id string, names ...string) map[string]idempotency.Job {
	t.Helper()
	ctx := context.Background()
	n := []string{"a", "b", "c", "d"}
	copy(n, names)
	step := func(key string) *tasks.Task { return tasks.NewRaw("wf:step", []byte(`{}`), id+":"+key) }
	res, err := b.client.EnqueueWorkflow(ctx, tasks.NewWorkflow(id).
		Add(n[0], step("a")).
		Add(n[1], step("b"), n[0]).
		Add(n[2], step("c"), n[0]).
		Add(n[3], step("d"), n[1], n[2]))
	require.NoError(t, err)
	jobs := map[string]idempotency.Job{}
	for i, name := range n {
		jobs[string(rune('a'+i))] = res.Tasks[name].Job
	}
	for _, m := range []struct{ task, status string }{{"a", "succeeded"}, {"b", "succeeded"}, {"c", "dead"}} {
		_, err := b.pool.Exec(ctx, `UPDATE keel_jobs SET status = $2, finished_at = now(), attempts = 1 WHERE id = $1`, jobs[m.task].ID, m.status)
		require.NoError(t, err)
	}
	require.Equal(t, idempotency.StatusWaiting, b.status(t, jobs["d"].ID))
	return jobs
}

// nodeTag finds a task's box in the workflow's SVG.
func nodeTag(id string) *regexp.Regexp {
	return regexp.MustCompile(`<a class="node status-(\w+)" id="node-` + id + `" data-task="([^"]*)" href="/jobs/` + id + `">`)
}

// The workflow page draws a box per task in its status's colour, in
// columns by depth, and a line per dependency; it lists the tasks and
// counts them by status. A job's page says what it waits for and what
// waits for it; an operator releases a waiting job, or cancels it.
func TestWorkflowPage(t *testing.T) {
	b := setup(t, nil)
	// A task name may carry anything, a bidi override included.
	jobs := b.diamond(t, "fulfil 7/ship?x", "a", "b", "c\u202eevil", "d")
	v := b.signIn(t, viewerName, viewerPassword)
	page := "/workflows/" + url.PathEscape("fulfil 7/ship?x")

	res := v.get(t, page)
	require.Equal(t, http.StatusOK, res.status, res.body)
	require.NotContains(t, res.body, "\u202e", "the task name's bidi override is shown as a code")
	require.Contains(t, res.body, "c[U&#43;202E]evil")
	for task, want := range map[string]string{"a": "succeeded", "b": "succeeded", "c": "dead", "d": "waiting"} {
		m := nodeTag(jobs[task].ID).FindStringSubmatch(res.body)
		require.NotNil(t, m, "no box for task %s", task)
		require.Equal(t, want, m[1], task)
		require.Contains(t, res.body, `id="task-`+jobs[task].ID+`"`, "the table lists task %s", task)
	}
	edges := regexp.MustCompile(`<path class="edge( met)?" data-from="([^"]+)" data-to="([^"]+)"`).FindAllStringSubmatch(res.body, -1)
	var got []string
	for _, e := range edges {
		got = append(got, e[2]+">"+e[3]+e[1])
	}
	a, bb, c, d := jobs["a"].ID, jobs["b"].ID, jobs["c"].ID, jobs["d"].ID
	require.ElementsMatch(t, []string{a + ">" + bb + " met", a + ">" + c + " met", bb + ">" + d + " met", c + ">" + d}, got,
		"an edge per dependency, solid where the parent succeeded")
	// Columns by depth: a, then b and c, then d.
	x := func(id string) string {
		return regexp.MustCompile(`id="node-` + id + `"[^>]*>\s*<title>[^<]*</title>\s*<rect x="(\d+)"`).FindStringSubmatch(res.body)[1]
	}
	require.Equal(t, x(bb), x(c))
	require.NotEqual(t, x(a), x(bb))
	require.NotEqual(t, x(c), x(d))
	require.Regexp(t, `id="count-succeeded">2 succeeded<`, res.body)
	require.Regexp(t, `id="count-dead">1 dead<`, res.body)
	require.Regexp(t, `id="count-waiting">1 waiting<`, res.body)

	res = v.get(t, "/workflows/no-such-workflow")
	require.Equal(t, http.StatusNotFound, res.status)
	require.Contains(t, res.body, "no workflow with id")
	require.Equal(t, http.StatusFound, b.anonymous().get(t, page).status, "signing in is required")
	// The look-up forms take a workflow's id.
	res = v.get(t, "/jobs?workflow="+url.QueryEscape(" fulfil 7/ship?x "))
	require.Equal(t, http.StatusSeeOther, res.status, res.body)
	require.Equal(t, page, res.header.Get("Location"))
	require.Equal(t, http.StatusOK, v.get(t, res.header.Get("Location")).status)
	res = v.get(t, "/jobs?workflow=nope")
	require.Equal(t, http.StatusNotFound, res.status)
	require.Contains(t, res.body, `no workflow with id &#34;nope&#34;`)
	require.Contains(t, res.body, `name="workflow" value="nope"`)

	// d's page: what it waits for, the dead parent that holds it, its
	// workflow; no Release for a viewer.
	res = v.get(t, "/jobs/"+d)
	require.Equal(t, http.StatusOK, res.status, res.body)
	require.Contains(t, res.body, `id="status">waiting<`)
	require.Contains(t, res.body, `<a id="workflow-link" href="`+page+`">`)
	require.Regexp(t, `id="parent-`+bb+`"><a href="/jobs/`+bb+`">.*</a> <span class="badge status-succeeded">`, res.body)
	require.Regexp(t, `id="parent-`+c+`"><a href="/jobs/`+c+`">.*</a> <span class="badge status-dead">dead</span> <span class="warn small dead-parent">this job waits until it is replayed and succeeds, or is released`, res.body)
	require.NotContains(t, res.body, `id="release"`)
	require.NotContains(t, res.body, `id="cancel"`)
	// Had c died after its completing InTx (its dependency met, its
	// effects in), d would not be held by it: the page says so.
	setMet := func(met bool) {
		_, err := b.pool.Exec(context.Background(), `WITH d AS (UPDATE keel_job_deps SET met_at = CASE WHEN $2 THEN now() END
			WHERE parent_id = $1) UPDATE keel_jobs SET effects_committed_at = CASE WHEN $2 THEN now() END WHERE id = $1`, c, met)
		require.NoError(t, err)
	}
	setMet(true)
	res = v.get(t, "/jobs/"+d)
	require.Regexp(t, `id="parent-`+c+`"><a href="/jobs/`+c+`">.*</a> <span class="badge status-dead">dead</span> <span class="muted small">met: its completing InTx committed`, res.body)
	require.NotContains(t, res.body, `class="warn small dead-parent"`)
	require.Contains(t, v.get(t, page).body, `<path class="edge met" data-from="`+c+`" data-to="`+d+`"`, "the graph draws it met")
	setMet(false)
	// a's page: what waits for it.
	res = v.get(t, "/jobs/"+a)
	require.Contains(t, res.body, `id="child-`+bb+`"`)
	require.Contains(t, res.body, `id="child-`+c+`"`)
	require.NotContains(t, res.body, `id="parent-`)
	// A job with no dependencies has no such section.
	lone := b.deadJob(t, "order:send_receipt", "order:1", "boom")
	require.NotContains(t, v.get(t, "/jobs/"+lone.ID).body, `id="deps"`)

	// The jobs list filters on waiting, and an operator may select a
	// waiting job to cancel it.
	require.Equal(t, []string{d}, listed(t, v, "/jobs?status=waiting"))

	// Release: operators only, with the form token.
	res = v.post(t, "/jobs/"+d+"/release", url.Values{"csrf": {v.token(t)}})
	require.Equal(t, http.StatusForbidden, res.status)
	op := b.signIn(t, operatorName, operatorPassword)
	res = op.get(t, "/jobs/"+d)
	require.Contains(t, res.body, `id="release"`)
	require.Contains(t, res.body, `id="cancel"`, "a waiting job can be cancelled")
	require.Regexp(t, `<tr id="row-`+d+`">\s*<td><input type="checkbox" name="id" value="`+d+`"`, op.get(t, "/jobs?status=waiting").body)
	res = op.post(t, "/jobs/"+d+"/release", url.Values{"note": {"no token"}})
	require.Equal(t, http.StatusForbidden, res.status)
	require.Equal(t, idempotency.StatusWaiting, b.status(t, d))
	tok := op.token(t)
	res = op.post(t, "/jobs/"+d+"/release", url.Values{"csrf": {tok}, "note": {"c done by hand"}})
	require.Equal(t, http.StatusSeeOther, res.status, res.body)
	require.Equal(t, "/jobs/"+d+"?done=released", res.header.Get("Location"))
	require.Equal(t, idempotency.StatusPending, b.status(t, d))
	au := b.audit(t, d)
	require.Equal(t, "release", au[0].Action)
	require.Equal(t, operatorName, au[0].Actor)
	require.Equal(t, "c done by hand", au[0].Note)
	res = op.get(t, "/jobs/"+d+"?done=released")
	require.Contains(t, res.body, "Released: the job no longer waits for its parents")
	require.NotContains(t, res.body, `id="release"`)
	require.NotContains(t, res.body, "this job waits until", "a job no longer waiting is not held by its dead parent")
	res = op.post(t, "/jobs/"+d+"/release", url.Values{"csrf": {tok}})
	require.Equal(t, "/jobs/"+d+"?done=already-released", res.header.Get("Location"))
	res = op.post(t, "/jobs/"+c+"/release", url.Values{"csrf": {tok}})
	require.Equal(t, http.StatusConflict, res.status, "a dead job does not wait")
	require.Contains(t, res.body, "release refused")
	require.Contains(t, op.get(t, page).body, `<a class="node status-pending" id="node-`+d+`"`)

	// A waiting job is cancelled from its page.
	after, err := b.client.Enqueue(context.Background(), tasks.NewRaw("wf:step", []byte(`{}`), "after-c", tasks.After(c)))
	require.NoError(t, err)
	require.Equal(t, idempotency.StatusWaiting, b.status(t, after.Job.ID))
	res = op.get(t, "/jobs/"+after.Job.ID)
	require.NotContains(t, res.body, `id="workflow"`, "not in a workflow")
	require.Contains(t, res.body, `id="parent-`+c+`"`)
	res = op.post(t, "/jobs/"+after.Job.ID+"/cancel", url.Values{"csrf": {tok}, "note": {"not needed"}})
	require.Equal(t, "/jobs/"+after.Job.ID+"?done=cancelled", res.header.Get("Location"))
	require.Equal(t, idempotency.StatusCancelled, b.status(t, after.Job.ID))
}

// In a browser: the workflow's graph, a box leading to its job's page,
// and the Release button.
func TestBrowserWorkflowPage(t *testing.T) {
	needChromium(t)
	b := setupAlone(t, nil)
	jobs := b.diamond(t, "order-9-fulfilment")
	ctx := newBrowser(t)
	signInBrowser(t, ctx, b.ts.URL, operatorName, operatorPassword, "/workflows/order-9-fulfilment")
	run(t, ctx, chromedp.WaitVisible(chromedp.ID("graph")))

	// A box per task in its status's colour, and a line per dependency.
	require.Equal(t, 4, eval[int](t, ctx, `document.querySelectorAll('#graph a.node').length`))
	for task, want := range map[string]string{"a": "succeeded", "b": "succeeded", "c": "dead", "d": "waiting"} {
		sel := `#graph a.node[data-task="` + task + `"]`
		require.True(t, eval[bool](t, ctx, `document.querySelector('`+sel+`').classList.contains('status-`+want+`')`), task)
		require.Equal(t, task, eval[string](t, ctx, `document.querySelector('`+sel+` text.task').textContent`))
	}
	require.NotEqual(t, eval[string](t, ctx, `getComputedStyle(document.querySelector('#graph a.node.status-dead rect')).fill`),
		eval[string](t, ctx, `getComputedStyle(document.querySelector('#graph a.node.status-waiting rect')).fill`))
	edges := eval[[]string](t, ctx, `[...document.querySelectorAll('#graph path.edge')].map(e => e.dataset.from + '>' + e.dataset.to)`)
	a, bb, c, d := jobs["a"].ID, jobs["b"].ID, jobs["c"].ID, jobs["d"].ID
	require.ElementsMatch(t, []string{a + ">" + bb, a + ">" + c, bb + ">" + d, c + ">" + d}, edges)
	// Each line runs left to right, from its parent's box to its child's.
	require.True(t, eval[bool](t, ctx, `[...document.querySelectorAll('#graph path.edge')].every(e => {
		const box = id => document.getElementById('node-' + id).querySelector('rect').getBBox();
		const p = box(e.dataset.from), c = box(e.dataset.to), len = e.getTotalLength();
		const s = e.getPointAtLength(0), t = e.getPointAtLength(len);
		return Math.abs(s.x - (p.x + p.width)) < 1 && t.x <= c.x && t.x > c.x - 4;
	})`))
	require.Equal(t, 4, eval[int](t, ctx, `document.querySelectorAll('#tasks tbody tr').length`))
	screenshot(t, ctx, t.TempDir(), "workflow.png")
	noCSPViolations(t, ctx, "the workflow page")

	// A box leads to its job, which says what it waits for.
	run(t, ctx, chromedp.Click(chromedp.CSS(`#graph a.node[data-task="d"] rect`)), chromedp.WaitVisible(chromedp.ID("deps")))
	require.Contains(t, eval[string](t, ctx, `document.location.pathname`), d)
	require.Equal(t, "waiting", text(t, ctx, "#status"))
	require.Contains(t, text(t, ctx, "#parent-"+c), "this job waits until it is replayed and succeeds, or is released")
	require.Contains(t, text(t, ctx, "#parent-"+bb), "succeeded")
	require.Equal(t, "order-9-fulfilment", text(t, ctx, "#workflow-link"))
	screenshot(t, ctx, t.TempDir(), "workflow-job.png")
	noCSPViolations(t, ctx, "a waiting job's page")

	// The operator releases it: no longer waiting.
	run(t, ctx, chromedp.SendKeys(chromedp.ID("release-note"), "c's work was done by hand"),
		chromedp.Click(chromedp.ID("release")), chromedp.WaitVisible(chromedp.CSS("p.flash")))
	require.Contains(t, text(t, ctx, "p.flash"), "Released")
	require.Equal(t, "pending", text(t, ctx, "#status"))
	require.Equal(t, 0, eval[int](t, ctx, `document.querySelectorAll('#release').length`))
	require.Contains(t, text(t, ctx, "table.audit"), "c's work was done by hand")
	require.Equal(t, idempotency.StatusPending, b.status(t, d))
	run(t, ctx, chromedp.Click(chromedp.ID("workflow-link")), chromedp.WaitVisible(chromedp.ID("graph")))
	require.True(t, eval[bool](t, ctx, `document.querySelector('#graph a.node[data-task="d"]').classList.contains('status-pending')`))
	require.False(t, strings.Contains(eval[string](t, ctx, `document.body.innerText`), "Refused"))

	// On a phone the graph shrinks to its card, and neither page scrolls
	// sideways.
	run(t, ctx, chromedp.EmulateViewport(390, 900), chromedp.Reload(), chromedp.WaitVisible(chromedp.ID("graph")))
	noPageOverflow(t, ctx, "the workflow page")
	require.True(t, eval[bool](t, ctx, `document.querySelector('#graph').getBoundingClientRect().right <=
		document.querySelector('#graph').closest('.card').getBoundingClientRect().right`), "the graph is wider than its card")
	run(t, ctx, chromedp.Navigate(b.ts.URL+"/jobs/"+d), chromedp.WaitVisible(chromedp.ID("deps")))
	noPageOverflow(t, ctx, "a job's dependencies")
}

// A parent of more jobs than its page lists (relatedShown, 100) shows the
// first of them and says how many more there are.
func TestJobPageCountsTheChildrenItDoesNotList(t *testing.T) {
	b := setup(t, nil)
	parent := b.deadJob(t, "order:charge", "order:many", "boom")
	var first string
	for i := range 103 {
		res, err := b.client.Enqueue(context.Background(), tasks.NewRaw("wf:step", []byte(`{}`), fmt.Sprintf("child-%03d", i), tasks.After(parent.ID)))
		require.NoError(t, err)
		if i == 0 {
			first = res.Job.ID
		}
	}
	body := b.signIn(t, viewerName, viewerPassword).get(t, "/jobs/"+parent.ID).body
	require.Contains(t, body, `id="child-`+first+`"`, "the first children are listed")
	require.Equal(t, 100, strings.Count(body, `id="child-`))
	require.Contains(t, body, "and 3 more")
}
