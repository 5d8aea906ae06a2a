package web_test

import (
	"context"
	"net/http"
	"net/url"
	"regexp"
	"testing"

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
// counts them by status.
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
}
