package web_test

import (
	"context"
	"net/http"
	"strings"
	"testing"

	"github.com/chromedp/chromedp"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/jobstore"
	"github.com/keeljobs/keel/tasks"
)

// batchWithMembers makes a sealed batch of three members: one succeeded,
// one dead, one pending.
func (b *bundle) batchWithMembers(t *testing.T, desc string) (jobstore.Batch, []idempotency.Job) {
	t.Helper()
	ctx := context.Background()
	batch, err := b.client.NewBatch(ctx, tasks.BatchSpec{Description: desc,
		OnComplete: tasks.NewRaw("billing:run_done", []byte(`{}`), "")})
	require.NoError(t, err)
	var jobs []idempotency.Job
	for _, k := range []string{"inv:1", "inv:2", "inv:3"} {
		r, err := b.client.Enqueue(ctx, tasks.NewRaw("billing:invoice", []byte(`{}`), k, tasks.InBatch(batch.ID)))
		require.NoError(t, err)
		jobs = append(jobs, r.Job)
	}
	_, err = b.pool.Exec(ctx, `UPDATE keel_jobs SET status = 'succeeded', finished_at = now() WHERE id = $1`, jobs[0].ID)
	require.NoError(t, err)
	_, err = b.pool.Exec(ctx, `UPDATE keel_jobs SET status = 'dead', finished_at = now(), last_error = 'x' WHERE id = $1`, jobs[1].ID)
	require.NoError(t, err)
	batch, err = b.client.SealBatch(ctx, batch.ID)
	require.NoError(t, err)
	return batch, jobs
}

func TestBatchPages(t *testing.T) {
	b := setup(t, nil)
	batch, jobs := b.batchWithMembers(t, `<b>billing</b> run`)
	v := b.signIn(t, viewerName, viewerPassword)

	res := v.get(t, "/batches")
	require.Equal(t, http.StatusOK, res.status, res.body)
	require.Contains(t, res.body, `id="batch-`+batch.ID+`"`)
	require.Contains(t, res.body, "&lt;b&gt;billing&lt;/b&gt; run", "the description is text")
	require.Contains(t, res.body, `state-sealed`)

	res = v.get(t, "/batches/"+batch.ID)
	require.Equal(t, http.StatusOK, res.status, res.body)
	require.NotContains(t, res.body, "<b>billing</b>")
	require.Contains(t, res.body, `<progress id="progress" max="3" value="2">`)
	require.Regexp(t, `id="n-succeeded">1<`, res.body)
	require.Regexp(t, `id="n-dead"><a href="/jobs\?batch=`+batch.ID+`&amp;status=dead">1</a>`, res.body)
	// That link lists the batch's dead member, not every dead job.
	other := b.deadJob(t, "order:send_receipt", "order:not-in-the-batch", "boom")
	dead := listed(t, v, "/jobs?batch="+batch.ID+"&status=dead")
	require.Len(t, dead, 1)
	require.NotEqual(t, other.ID, dead[0])
	require.ElementsMatch(t, []string{jobs[0].ID, jobs[1].ID, jobs[2].ID}, listed(t, v, "/jobs?batch="+batch.ID))
	require.Regexp(t, `id="n-pending">1<`, res.body)
	require.Contains(t, res.body, `id="member-`+jobs[2].ID+`"`, "the open member is listed")
	require.NotContains(t, res.body, `id="member-`+jobs[0].ID+`"`)
	require.Contains(t, res.body, "not enqueued yet")
	// A member waiting (for its parents, or held by its key) is open too.
	_, err := b.pool.Exec(context.Background(), `UPDATE keel_jobs SET status = 'waiting' WHERE id = $1`, jobs[2].ID)
	require.NoError(t, err)
	res = v.get(t, "/batches/"+batch.ID)
	require.Regexp(t, `id="n-pending">0 \(and 1 waiting\)<`, res.body)
	require.Contains(t, res.body, `id="member-`+jobs[2].ID+`"`, "the waiting member is listed")

	// The last member ends: the page links the callback job.
	_, err = b.pool.Exec(context.Background(), `UPDATE keel_jobs SET status = 'cancelled', finished_at = now() WHERE id = $1`, jobs[2].ID)
	require.NoError(t, err)
	done, err := b.store.GetBatch(context.Background(), batch.ID)
	require.NoError(t, err)
	res = v.get(t, "/batches/"+batch.ID)
	require.Equal(t, http.StatusOK, res.status, res.body)
	require.Contains(t, res.body, `<a href="/jobs/`+done.CompleteJobID+`">job `+done.CompleteJobID+`</a> <span class="badge status-pending">pending</span>`)
	require.Contains(t, res.body, "Every member has ended.")

	// A member's page links its batch.
	res = v.get(t, "/jobs/"+jobs[0].ID)
	require.Equal(t, http.StatusOK, res.status, res.body)
	require.Contains(t, res.body, `href="/batches/`+batch.ID+`"`)

	res = v.get(t, "/batches?open=1")
	require.Equal(t, http.StatusOK, res.status, res.body)
	require.NotContains(t, res.body, `id="batch-`+batch.ID+`"`, "a complete batch is not open")

	res = v.get(t, "/batches/01936f3e-8c1a-7b2e-9f00-1a2b3c4d5e6f")
	require.Equal(t, http.StatusNotFound, res.status)
	require.Contains(t, res.body, "no batch with id")
	require.Equal(t, http.StatusFound, b.anonymous().get(t, "/batches").status, "signing in is required")
}

func TestBrowserBatchPage(t *testing.T) {
	needChromium(t)
	b := setupAlone(t, nil)
	batch, jobs := b.batchWithMembers(t, "billing run 11")

	ctx := newBrowser(t)
	signInBrowser(t, ctx, b.ts.URL, viewerName, viewerPassword, "/batches")
	run(t, ctx, chromedp.WaitVisible(chromedp.ID("batches")), chromedp.Click(chromedp.CSS(`#batch-`+batch.ID+` a`)),
		chromedp.WaitVisible(chromedp.ID("progress")))
	require.Equal(t, 2, eval[int](t, ctx, `document.querySelector('#progress').value`))
	require.Equal(t, 3, eval[int](t, ctx, `document.querySelector('#progress').max`))
	require.Equal(t, "sealed", text(t, ctx, "#state"))
	require.True(t, strings.HasPrefix(text(t, ctx, "#callback-complete"), "on complete: billing:run_done"))
	screenshot(t, ctx, t.TempDir(), "batch.png")
	noCSPViolations(t, ctx, "the batch page")

	// "Dead: 1" leads to the batch's dead member, not to every dead job.
	b.deadJob(t, "order:send_receipt", "order:elsewhere", "boom")
	run(t, ctx, chromedp.Click(chromedp.CSS(`#n-dead a`)), chromedp.WaitVisible(chromedp.CSS(`table.jobs`)))
	require.Equal(t, 1, eval[int](t, ctx, `document.querySelectorAll('table.jobs tbody tr').length`))
	require.Equal(t, batch.ID, eval[string](t, ctx, `document.querySelector('#f-batch').value`))
	noCSPViolations(t, ctx, "the batch's dead members")
	run(t, ctx, chromedp.Navigate(b.ts.URL+"/batches/"+batch.ID), chromedp.WaitVisible(chromedp.ID("progress")))

	run(t, ctx, chromedp.Click(chromedp.CSS(`#member-`+jobs[2].ID+` a`)), chromedp.WaitVisible(chromedp.ID("batch-link")))
	require.Equal(t, "batch "+batch.ID, text(t, ctx, "#batch-link"))
}
