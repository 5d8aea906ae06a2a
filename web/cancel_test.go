package web_test

import (
	"context"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/hibiken/asynq"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/tasks"
)

// waitingJob is a keel job scheduled for later: pending in the ledger,
// scheduled in asynq.
func (b *bundle) waitingJob(t *testing.T, key string) idempotency.Job {
	t.Helper()
	res, err := b.client.Enqueue(context.Background(), tasks.NewRaw("order:send_receipt", []byte(`{}`), key, tasks.Delay(time.Hour)))
	require.NoError(t, err)
	require.True(t, res.Published)
	return res.Job
}

func (b *bundle) status(t *testing.T, id string) idempotency.Status {
	t.Helper()
	j, err := b.store.Get(context.Background(), id)
	require.NoError(t, err)
	return j.Status
}

func TestCancelFromTheJobPage(t *testing.T) {
	b := setup(t, nil)
	j := b.waitingJob(t, "order:1")
	insp := asynq.NewInspector(b.redis)
	defer insp.Close()

	// Viewers see no button and cannot post; a post without the form token
	// is refused.
	v := b.signIn(t, viewerName, viewerPassword)
	require.NotContains(t, v.get(t, "/jobs/"+j.ID).body, `id="cancel"`)
	res := v.post(t, "/jobs/"+j.ID+"/cancel", url.Values{"csrf": {v.token(t)}})
	require.Equal(t, http.StatusForbidden, res.status)
	op := b.signIn(t, operatorName, operatorPassword)
	require.Contains(t, op.get(t, "/jobs/"+j.ID).body, `id="cancel"`)
	res = op.post(t, "/jobs/"+j.ID+"/cancel", url.Values{"note": {"no token"}})
	require.Equal(t, http.StatusForbidden, res.status)
	require.Equal(t, idempotency.StatusPending, b.status(t, j.ID))

	tok := op.token(t)
	res = op.post(t, "/jobs/"+j.ID+"/cancel", url.Values{"csrf": {tok}, "note": {"customer withdrew"}})
	require.Equal(t, http.StatusSeeOther, res.status, res.body)
	require.Equal(t, "/jobs/"+j.ID+"?done=cancelled", res.header.Get("Location"))
	require.Equal(t, idempotency.StatusCancelled, b.status(t, j.ID))
	_, err := insp.GetTaskInfo(j.Queue, j.ID)
	require.ErrorIs(t, err, asynq.ErrTaskNotFound)
	a := b.audit(t, j.ID)
	require.Len(t, a, 1)
	require.Equal(t, "cancel", a[0].Action)
	require.Equal(t, operatorName, a[0].Actor)
	require.Equal(t, "customer withdrew", a[0].Note)
	page := op.get(t, "/jobs/"+j.ID+"?done=cancelled")
	require.Contains(t, page.body, "Cancelled: the job will not run.")
	require.Contains(t, page.body, "Cancelled by "+operatorName)
	require.NotContains(t, page.body, `id="cancel"`, "a cancelled job offers no cancel")

	res = op.post(t, "/jobs/"+j.ID+"/cancel", url.Values{"csrf": {tok}})
	require.Equal(t, "/jobs/"+j.ID+"?done=already-cancelled", res.header.Get("Location"))

	// A job that ended is refused with its status.
	dead := b.deadJob(t, "order:send_receipt", "order:2", "boom")
	res = op.post(t, "/jobs/"+dead.ID+"/cancel", url.Values{"csrf": {tok}})
	require.Equal(t, http.StatusConflict, res.status)
	require.Contains(t, res.body, "cannot be cancelled")
	require.Equal(t, idempotency.StatusDead, b.status(t, dead.ID))

	// The jobs list filters on the new status.
	list := op.get(t, "/jobs?status=cancelled")
	require.Equal(t, http.StatusOK, list.status)
	require.Contains(t, list.body, "row-"+j.ID)
	require.NotContains(t, list.body, "row-"+dead.ID)
}

// In asynqmon, cancelling an active task or deleting a waiting one of a
// keel job is keel's cancel: otherwise asynq retries the cancelled run and
// the reconciler publishes the deleted task again.
func TestAsynqmonCancelAndDeleteAreKeelsCancel(t *testing.T) {
	b := setup(t, nil)
	op := b.signIn(t, operatorName, operatorPassword)
	insp := asynq.NewInspector(b.redis)
	defer insp.Close()

	j := b.waitingJob(t, "order:1")
	res := op.do(t, http.MethodDelete, "/monitoring/api/queues/default/scheduled_tasks/"+j.ID, nil, nil)
	require.Equal(t, http.StatusNoContent, res.status, res.body)
	require.Equal(t, idempotency.StatusCancelled, b.status(t, j.ID))
	a := b.audit(t, j.ID)
	require.Equal(t, "cancel", a[0].Action)
	require.Equal(t, "cancelled from asynqmon", a[0].Note)
	_, err := insp.GetTaskInfo("default", j.ID)
	require.ErrorIs(t, err, asynq.ErrTaskNotFound)

	j2, j3 := b.waitingJob(t, "order:2"), b.waitingJob(t, "order:3")
	res = op.do(t, http.MethodPost, "/monitoring/api/queues/default/scheduled_tasks:batch_delete",
		strings.NewReader(`{"task_ids":["`+j2.ID+`","`+j3.ID+`"]}`), map[string]string{"Content-Type": "application/json"})
	require.Equal(t, http.StatusOK, res.status, res.body)
	require.JSONEq(t, `{"deleted_ids":["`+j2.ID+`","`+j3.ID+`"],"error_ids":[]}`, res.body)
	require.Equal(t, idempotency.StatusCancelled, b.status(t, j2.ID))
	require.Equal(t, idempotency.StatusCancelled, b.status(t, j3.ID))

	// A running job (running in the ledger; no worker here).
	j4 := b.waitingJob(t, "order:4")
	_, err = b.pool.Exec(t.Context(), `UPDATE keel_jobs SET status = 'running', lease_holder = 'w', lease_until = now() + interval '1 minute', attempts = 1 WHERE id = $1`, j4.ID)
	require.NoError(t, err)
	res = op.do(t, http.MethodPost, "/monitoring/api/queues/default/active_tasks/"+j4.ID+":cancel", nil, nil)
	require.Equal(t, http.StatusNoContent, res.status, res.body)
	require.Equal(t, idempotency.StatusCancelled, b.status(t, j4.ID))

	// All at once is refused with a pointer to keel's list.
	for _, c := range []struct{ method, path string }{
		{http.MethodPost, "/monitoring/api/queues/default/active_tasks:cancel_all"},
		{http.MethodDelete, "/monitoring/api/queues/default/pending_tasks:delete_all"},
	} {
		res = op.do(t, c.method, c.path, nil, nil)
		require.Equal(t, http.StatusConflict, res.status, c.path)
		require.Contains(t, res.body, "/jobs")
	}

	// A stray task of a job that ended is asynqmon's to delete; the job
	// stays as it is.
	dead := b.deadJob(t, "order:send_receipt", "order:5", "boom")
	res = op.do(t, http.MethodDelete, "/monitoring/api/queues/default/pending_tasks/"+dead.ID, nil, nil)
	require.Equal(t, http.StatusNoContent, res.status, res.body)
	require.Equal(t, idempotency.StatusDead, b.status(t, dead.ID))
	_, err = insp.GetTaskInfo("default", dead.ID)
	require.ErrorIs(t, err, asynq.ErrTaskNotFound)

	// Viewers cannot.
	j6 := b.waitingJob(t, "order:6")
	v := b.signIn(t, viewerName, viewerPassword)
	res = v.do(t, http.MethodDelete, "/monitoring/api/queues/default/scheduled_tasks/"+j6.ID, nil, nil)
	require.Equal(t, http.StatusForbidden, res.status)
	require.Equal(t, idempotency.StatusPending, b.status(t, j6.ID))
}

func TestBrowserCancel(t *testing.T) {
	needChromium(t)
	b := setupAlone(t, nil)
	one, two, three := b.waitingJob(t, "order:1"), b.waitingJob(t, "order:2"), b.waitingJob(t, "order:3")
	dead := b.deadJob(t, "order:send_receipt", "order:4", "boom")

	ctx := newBrowser(t)
	base := b.ts.URL
	signInBrowser(t, ctx, base, operatorName, operatorPassword, "/jobs/"+one.ID)
	run(t, ctx,
		chromedp.WaitVisible(chromedp.ID("cancel")),
		chromedp.SendKeys(chromedp.ID("cancel-note"), "customer withdrew"),
		chromedp.Click(chromedp.ID("cancel")),
	)
	waitJS(t, ctx, `document.location.search.includes('done=cancelled') && !!document.querySelector('#status')`,
		"the job page did not come back after the cancel")
	require.Equal(t, "cancelled", text(t, ctx, "#status"))
	require.Contains(t, text(t, ctx, "main"), "customer withdrew")
	require.Equal(t, 0, eval[int](t, ctx, `document.querySelectorAll('#cancel').length`))
	noCSPViolations(t, ctx, "the cancelled job's page")
	require.Equal(t, idempotency.StatusCancelled, b.status(t, one.ID))

	// Bulk from the jobs list: the dead job among the selection is left alone.
	run(t, ctx, chromedp.Navigate(base+"/jobs"), chromedp.WaitVisible(chromedp.ID("selected-cancel")))
	run(t, ctx,
		chromedp.Click(chromedp.CSS(`#row-`+two.ID+` input[type=checkbox]`)),
		chromedp.Click(chromedp.CSS(`#row-`+three.ID+` input[type=checkbox]`)),
		chromedp.Click(chromedp.CSS(`#row-`+dead.ID+` input[type=checkbox]`)),
		chromedp.Click(chromedp.ID("selected-cancel")),
		chromedp.WaitVisible(chromedp.ID("confirm")),
	)
	require.Contains(t, text(t, ctx, "main"), "Of the 3 jobs you selected, 2 are not finished now")
	require.Equal(t, "Cancel 2 jobs", text(t, ctx, "#confirm"))
	run(t, ctx,
		chromedp.SendKeys(chromedp.CSS(`textarea[name="note"]`), "duplicate orders"),
		chromedp.Click(chromedp.ID("confirm")),
	)
	waitJS(t, ctx, `(document.querySelector('main h1') || {innerText: ''}).innerText.startsWith('Bulk cancel')`,
		"the bulk cancel's result did not show")
	require.Equal(t, "Bulk cancel: 2 of 2 done", text(t, ctx, "main h1"))
	noCSPViolations(t, ctx, "the bulk cancel's result")
	for id, want := range map[string]idempotency.Status{two.ID: idempotency.StatusCancelled, three.ID: idempotency.StatusCancelled,
		dead.ID: idempotency.StatusDead} {
		require.Equal(t, want, b.status(t, id))
	}
	a := b.audit(t, two.ID)
	require.Equal(t, "duplicate orders", a[0].Note)
}

// Archiving a waiting task of a keel job in asynqmon would look done (204)
// and then be undone: the ledger still says the job should run, so the
// reconciler removes the archived copy and publishes it again. keel refuses
// it with a pointer to the job's page, where it can be cancelled; tasks keel
// does not know are asynqmon's to archive.
func TestAsynqmonArchiveOfAWaitingKeelJobIsRefused(t *testing.T) {
	b := setup(t, nil)
	op := b.signIn(t, operatorName, operatorPassword)
	insp := asynq.NewInspector(b.redis)
	defer insp.Close()

	j := b.waitingJob(t, "order:1")
	res := op.do(t, http.MethodPost, "/monitoring/api/queues/default/scheduled_tasks/"+j.ID+":archive", nil, nil)
	require.Equal(t, http.StatusConflict, res.status, res.body)
	require.Contains(t, res.body, "/jobs/"+j.ID)
	info, err := insp.GetTaskInfo("default", j.ID)
	require.NoError(t, err)
	require.Equal(t, asynq.TaskStateScheduled, info.State, "not archived")
	require.Equal(t, idempotency.StatusPending, b.status(t, j.ID))

	c := asynq.NewClient(b.redis)
	defer c.Close()
	other, err := c.Enqueue(asynq.NewTask("not:keel", nil), asynq.Queue("default"), asynq.ProcessIn(time.Hour))
	require.NoError(t, err)
	j2 := b.waitingJob(t, "order:2")
	res = op.do(t, http.MethodPost, "/monitoring/api/queues/default/scheduled_tasks:batch_archive",
		strings.NewReader(`{"task_ids":["`+j2.ID+`","`+other.ID+`"]}`), map[string]string{"Content-Type": "application/json"})
	require.Equal(t, http.StatusOK, res.status, res.body)
	require.JSONEq(t, `{"archived_ids":["`+other.ID+`"],"error_ids":["`+j2.ID+`"]}`, res.body)
	info, err = insp.GetTaskInfo("default", j2.ID)
	require.NoError(t, err)
	require.Equal(t, asynq.TaskStateScheduled, info.State)
	info, err = insp.GetTaskInfo("default", other.ID)
	require.NoError(t, err)
	require.Equal(t, asynq.TaskStateArchived, info.State, "a task keel does not know is archived")

	for _, q := range []string{"pending", "scheduled", "retry"} {
		res = op.do(t, http.MethodPost, "/monitoring/api/queues/default/"+q+"_tasks:archive_all", nil, nil)
		require.Equal(t, http.StatusConflict, res.status, q)
		require.Contains(t, res.body, "/jobs", q)
	}
	info, err = insp.GetTaskInfo("default", j.ID)
	require.NoError(t, err)
	require.Equal(t, asynq.TaskStateScheduled, info.State)
}
