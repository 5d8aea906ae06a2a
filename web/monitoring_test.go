package web_test

import (
	"net/http"
	"net/url"
	"strings"
	"testing"

	"github.com/hibiken/asynq"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/tasks"
)

// archivedDeadJob is a keel job that died: dead in the ledger, archived in
// asynq.
func (b *bundle) archivedDeadJob(t *testing.T, key string) idempotency.Job {
	t.Helper()
	j := b.deadJob(t, "order:send_receipt", key, "boom")
	insp := asynq.NewInspector(b.redis)
	defer insp.Close()
	require.NoError(t, insp.ArchiveTask(j.Queue, j.ID))
	return j
}

func TestAsynqmonRunOfADeadJobIsKeelsReplay(t *testing.T) {
	b := setup(t, nil)
	j := b.archivedDeadJob(t, "order:1")
	op := b.signIn(t, operatorName, operatorPassword)

	res := op.do(t, http.MethodPost, "/monitoring/api/queues/default/archived_tasks/"+j.ID+":run", nil, nil)
	require.Equal(t, http.StatusNoContent, res.status, res.body)
	got, err := b.store.Get(t.Context(), j.ID)
	require.NoError(t, err)
	require.Equal(t, idempotency.StatusPending, got.Status, "replayed through the ledger, not run behind its back")
	a := b.audit(t, j.ID)
	require.Equal(t, "replay", a[0].Action)
	require.Equal(t, operatorName, a[0].Actor)
	require.Equal(t, "run from asynqmon", a[0].Note)
	insp := asynq.NewInspector(b.redis)
	defer insp.Close()
	_, err = insp.GetTaskInfo("default", j.ID)
	require.ErrorIs(t, err, asynq.ErrTaskNotFound, "the relay, not asynqmon, hands it back to Redis")

	// Batches too; and running them all at once is refused with a pointer.
	j2, j3 := b.archivedDeadJob(t, "order:2"), b.archivedDeadJob(t, "order:3")
	res = op.do(t, http.MethodPost, "/monitoring/api/queues/default/archived_tasks:batch_run",
		strings.NewReader(`{"task_ids":["`+j2.ID+`","`+j3.ID+`"]}`), map[string]string{"Content-Type": "application/json"})
	require.Equal(t, http.StatusOK, res.status, res.body)
	require.JSONEq(t, `{"pending_ids":["`+j2.ID+`","`+j3.ID+`"],"error_ids":[]}`, res.body)
	for _, id := range []string{j2.ID, j3.ID} {
		got, err := b.store.Get(t.Context(), id)
		require.NoError(t, err)
		require.Equal(t, idempotency.StatusPending, got.Status)
	}
	res = op.do(t, http.MethodPost, "/monitoring/api/queues/default/archived_tasks:run_all", nil, nil)
	require.Equal(t, http.StatusConflict, res.status)
	require.Contains(t, res.body, "/dead")

	// A job with a step in doubt is not run: the person must say first.
	j4 := b.archivedDeadJob(t, "order:4")
	_, err = b.pool.Exec(t.Context(), `INSERT INTO keel_steps (job_id, name, status) VALUES ($1, 'mail', 'started')`, j4.ID)
	require.NoError(t, err)
	res = op.do(t, http.MethodPost, "/monitoring/api/queues/default/archived_tasks/"+j4.ID+":run", nil, nil)
	require.Equal(t, http.StatusConflict, res.status)
	require.Contains(t, res.body, "/jobs/"+j4.ID)
	info, err := insp.GetTaskInfo("default", j4.ID)
	require.NoError(t, err)
	require.Equal(t, asynq.TaskStateArchived, info.State)
}

func TestAsynqmonLoadsNothingFromElsewhereAndLinksBack(t *testing.T) {
	b := setup(t, nil)
	v := b.signIn(t, viewerName, viewerPassword)
	for _, p := range []string{"/monitoring/", "/monitoring/queues/default"} {
		res := v.get(t, p)
		require.Equal(t, http.StatusOK, res.status, p)
		require.NotContains(t, res.body, "https://", p)
		require.Contains(t, res.body, `<a id="keel-back" href="/"`, p)
		csp := res.header.Get("Content-Security-Policy")
		require.NotContains(t, csp, "https:", p)
		require.Contains(t, res.body, `window.FLAG_READ_ONLY="true"`)
	}
}

type panickyOrder struct {
	OrderID  string `json:"order_id"`
	Customer *struct {
		Email string `json:"email"`
	} `json:"customer"`
}

// A kind's Summary with a bug of its own: it reads the customer of an order
// that has none.
var panickySummary = tasks.Define[panickyOrder]("test:panicky_summary",
	tasks.Key(func(o panickyOrder) string { return o.OrderID }),
	tasks.Summary(func(o panickyOrder) string { return "order " + o.OrderID + " for " + o.Customer.Email }))

// asynqmon shows each task's payload through the kinds' Summary functions
// (the redaction): one that panics on one payload must not break the
// queue's page for every task on it, nor show the payload it was to redact.
func TestAsynqmonListsATaskWhoseSummaryPanics(t *testing.T) {
	b := setup(t, nil)
	c := asynq.NewClient(b.redis)
	defer c.Close()
	_, err := c.Enqueue(asynq.NewTask(panickySummary.Name(), []byte(`{"order_id":"p-1","secret":"s3cret"}`)), asynq.Queue("default"))
	require.NoError(t, err)
	_, err = c.Enqueue(asynq.NewTask(panickySummary.Name(), []byte(`{"order_id":"p-2","customer":{"email":"a@example.com"}}`)), asynq.Queue("default"))
	require.NoError(t, err)
	v := b.signIn(t, viewerName, viewerPassword)
	res := v.get(t, "/monitoring/api/queues/default/pending_tasks")
	require.Equal(t, http.StatusOK, res.status, res.body)
	require.Contains(t, res.body, "order p-2 for a@example.com")
	require.Contains(t, res.body, "Summary panicked")
	require.NotContains(t, res.body, "s3cret")
}

type mail struct {
	To string `json:"to"`
}

// bidiKind's name reads "bidi:send_mail" where U+202E is obeyed.
var bidiKind = tasks.Define[mail]("bidi:\u202eliam_dnes", tasks.Key(func(m mail) string { return m.To }))

// asynqmon renders what its API returns as it is: keel's proxy shows
// characters that reorder or hide text as codes there too.
func TestAsynqmonShowsHiddenCharactersAsCodes(t *testing.T) {
	b := setup(t, nil)
	c := asynq.NewClient(b.redis)
	defer c.Close()
	_, err := c.Enqueue(asynq.NewTask(bidiKind.Name(), []byte("{\"to\":\"a\u00adb\u2028c\U000e0041d\u3164\"}")), asynq.Queue("default"))
	require.NoError(t, err)
	v := b.signIn(t, viewerName, viewerPassword)
	for _, p := range []string{"/monitoring/api/queues/default/pending_tasks", "/monitoring/api/queues/default/pending_tasks?page=1&page_size=20"} {
		res := v.get(t, p)
		require.Equal(t, http.StatusOK, res.status, res.body)
		for _, r := range []string{"\u202e", "\u00ad", "\u2028", "\U000e0041", "\u3164", `\u202e`, `\u2028`} {
			require.NotContains(t, res.body, r, "%q in %s", r, p)
		}
		require.Contains(t, res.body, "bidi:[U+202E]liam_dnes")
		require.Contains(t, res.body, "a[U+00AD]b[U+2028]c[U+E0041]d[U+3164]")
		require.Equal(t, "application/json", res.header.Get("Content-Type"))
	}
}

// Queue names may hold dots: every page of the app is keel's wrapped index,
// whatever its path looks like, while asynqmon's files are its own.
func TestAsynqmonPagesWithADotAreWrapped(t *testing.T) {
	b := setup(t, nil)
	v := b.signIn(t, viewerName, viewerPassword)
	for _, p := range []string{"/monitoring/queues/reports.v2", "/monitoring/queues/reports.v2/tasks/x.y", "/monitoring/a.b",
		"/monitoring/static/nothing-here.js", "/monitoring/servers"} {
		res := v.get(t, p)
		require.Equal(t, http.StatusOK, res.status, p)
		require.Contains(t, res.body, `<a id="keel-back"`, p)
		require.NotContains(t, res.body, "https://", p)
	}
	res := v.get(t, "/monitoring/favicon.ico")
	require.Equal(t, http.StatusOK, res.status)
	require.NotContains(t, res.body, "keel-back")
}

// The job's page, a bulk action and asynqmon replay a job through the one
// operator API: each leaves the job as inspect's Replay does, with the
// same audit row (action, actor, the note as given).
func TestEveryReplayPathWritesTheSameAuditRow(t *testing.T) {
	b := setup(t, nil)
	op := b.signIn(t, operatorName, operatorPassword)
	page, bulk, mon, api := b.archivedDeadJob(t, "same:1"), b.archivedDeadJob(t, "same:2"),
		b.archivedDeadJob(t, "same:3"), b.archivedDeadJob(t, "same:4")

	res := op.post(t, "/jobs/"+page.ID+"/replay", url.Values{"csrf": {op.token(t)}, "note": {"same"}})
	require.Equal(t, http.StatusSeeOther, res.status, res.body)
	res = op.post(t, "/dead/bulk", url.Values{"csrf": {op.token(t)}, "action": {"replay"}, "id": {bulk.ID},
		"expect": {"1"}, "note": {"same"}})
	require.Equal(t, http.StatusOK, res.status, res.body)
	res = op.do(t, http.MethodPost, "/monitoring/api/queues/default/archived_tasks/"+mon.ID+":run", nil, nil)
	require.Equal(t, http.StatusNoContent, res.status, res.body)
	_, err := b.ops.Replay(t.Context(), api.ID, operatorName, "same")
	require.NoError(t, err)

	type shape struct{ Action, Actor, Note string }
	want := shape{"replay", operatorName, "same"}
	for name, j := range map[string]idempotency.Job{"page": page, "bulk": bulk, "asynqmon": mon, "api": api} {
		a := b.audit(t, j.ID)
		require.NotEmpty(t, a, name)
		w := want
		if name == "asynqmon" {
			w.Note = "run from asynqmon"
			// And asynqmon's request itself, after the replay it made.
			require.Len(t, a, 2, name)
			require.Equal(t, shape{"asynqmon POST /queues/default/archived_tasks/" + mon.ID + ":run", operatorName, "answered 204"},
				shape{a[1].Action, a[1].Actor, a[1].Note})
		} else {
			require.Len(t, a, 1, name)
		}
		require.Equal(t, w, shape{a[0].Action, a[0].Actor, a[0].Note}, name)
		got, err := b.store.Get(t.Context(), j.ID)
		require.NoError(t, err)
		require.Equal(t, idempotency.StatusPending, got.Status, name)
		require.Zero(t, got.Attempts, name)
		require.Nil(t, got.PublishedAt, name)
	}
}
