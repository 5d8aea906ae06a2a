package web_test

import (
	"net/http"
	"net/url"
	"strings"
	"testing"

	"github.com/hibiken/asynq"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/tasks"
)

type plainPayload struct {
	Note  string `json:"note"`
	Items []int  `json:"items"`
}

// plainKind is declared in this program and has no Summary: nothing of it
// is to be redacted, and its payload is shown as it is.
var plainKind = tasks.Define[plainPayload]("test:plain", tasks.Key(func(p plainPayload) string { return p.Note }))

// A kind this program does not declare: the worker program that does
// redacts its customers' emails (the stored summary is what it wrote).
const (
	foreignKind    = "customer:welcome"
	foreignEmail   = "jane.doe@example.com"
	foreignSummary = "welcome mail for customer 42 (email redacted)"
)

func TestPayloadsOfKindsThisProgramDoesNotDeclareAreHidden(t *testing.T) {
	b := setup(t, nil)
	res, err := b.client.Enqueue(t.Context(), tasks.NewRaw(foreignKind, []byte(`{"customer":42,"email":"`+foreignEmail+`"}`), "customer:42"))
	require.NoError(t, err)
	id := res.Job.ID
	_, err = b.pool.Exec(t.Context(), `UPDATE keel_jobs SET payload_summary = $2 WHERE id = $1`, id, foreignSummary)
	require.NoError(t, err)
	c := asynq.NewClient(b.redis)
	defer c.Close()
	_, err = c.Enqueue(asynq.NewTask(foreignKind, []byte(`{"customer":43,"email":"`+foreignEmail+`"}`)), asynq.Queue("default"))
	require.NoError(t, err)

	v := b.signIn(t, viewerName, viewerPassword)
	page := v.get(t, "/jobs/"+id)
	require.Equal(t, http.StatusOK, page.status)
	require.NotContains(t, page.body, foreignEmail, "the job's page")
	require.Contains(t, page.body, foreignSummary)
	require.Contains(t, page.body, "does not declare")
	require.NotContains(t, page.body, `id="show-payload"`, "viewers cannot ask for it")
	for _, p := range []string{"/monitoring/api/queues/default/pending_tasks", "/dead", "/jobs"} {
		require.NotContains(t, v.get(t, p).body, foreignEmail, p)
	}
	r := v.post(t, "/jobs/"+id+"/payload", url.Values{"csrf": {v.token(t)}})
	require.Equal(t, http.StatusForbidden, r.status)

	// An operator sees it on request, and the request is audited.
	op := b.signIn(t, operatorName, operatorPassword)
	page = op.get(t, "/jobs/"+id)
	require.NotContains(t, page.body, foreignEmail)
	require.Contains(t, page.body, `id="show-payload"`)
	require.NotContains(t, op.get(t, "/monitoring/api/queues/default/pending_tasks").body, foreignEmail)
	r = op.post(t, "/jobs/"+id+"/payload", url.Values{"csrf": {op.token(t)}})
	require.Equal(t, http.StatusOK, r.status, r.body)
	require.Contains(t, r.body, foreignEmail)
	require.Equal(t, "no-store", r.header.Get("Cache-Control"))
	a := b.audit(t, id)
	require.Equal(t, "show-payload", a[len(a)-1].Action)
	require.Equal(t, operatorName, a[len(a)-1].Actor)
	require.NotContains(t, op.get(t, "/jobs/"+id).body, foreignEmail, "shown once, not from then on")

	// A kind this program declares is shown through its own Summary (none
	// here: the payload itself).
	res, err = b.client.Enqueue(t.Context(), plainKind.New(plainPayload{Note: "n-1", Items: []int{1}}))
	require.NoError(t, err)
	body := v.get(t, "/jobs/"+res.Job.ID).body
	require.Contains(t, body, "&#34;note&#34;: &#34;n-1&#34;")
	require.False(t, strings.Contains(body, "does not declare"))
}

// leakedKind is declared in this test binary, as a kind of another program
// imported by mistake would be, but no dashboard below is told of it.
var leakedKind = tasks.Define[plainPayload]("test:leaked", tasks.Key(func(p plainPayload) string { return p.Note }))

func TestKindsDeclaredElsewhereInTheProcessAreNotTheDashboards(t *testing.T) {
	b := setup(t, nil)
	res, err := b.client.Enqueue(t.Context(), leakedKind.New(plainPayload{Note: "secret-note"}))
	require.NoError(t, err)
	body := b.signIn(t, viewerName, viewerPassword).get(t, "/jobs/"+res.Job.ID).body
	require.NotContains(t, body, "&#34;note&#34;", "its payload, unredacted")
	require.Contains(t, body, "does not declare")
}
