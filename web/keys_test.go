package web_test

import (
	"context"
	"fmt"
	"net/url"
	"testing"

	"github.com/chromedp/chromedp"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/tasks"
)

type tenantJob struct {
	Tenant string `json:"tenant"`
	N      int    `json:"n"`
}

var tenantWork = tasks.Define[tenantJob]("fair:work",
	tasks.Key(func(j tenantJob) string { return fmt.Sprint(j.Tenant, "/", j.N) }),
	tasks.ConcurrencyKey(func(j tenantJob) string { return j.Tenant }, 1))

// flood enqueues n jobs of tenant and returns the last (held once n > 1).
func (b *bundle) flood(t *testing.T, tenant string, n int) *tasks.Result {
	t.Helper()
	var last *tasks.Result
	for i := range n {
		var err error
		last, err = b.client.Enqueue(context.Background(), tenantWork.New(tenantJob{Tenant: tenant, N: i}))
		require.NoError(t, err)
	}
	return last
}

// A held job's page says which key it waits for and since when, and
// leads to the key's counts; the keys page lists kinds with held jobs and
// a kind's keys.
func TestKeysPages(t *testing.T) {
	b := setup(t, nil)
	held := b.flood(t, "acme <b>&", 3)
	b.flood(t, "globex", 1)
	v := b.signIn(t, viewerName, viewerPassword)

	page := v.get(t, "/jobs/"+held.Job.ID)
	require.Contains(t, page.body, `id="held"`)
	require.Contains(t, page.body, "Held: waiting for a slot of its concurrency key acme &lt;b&gt;&amp;")
	require.Contains(t, page.body, `href="/keys?kind=fair%3awork&amp;key=acme%20%3cb%3e%26"`)
	require.NotContains(t, page.body, `id="deps"`, "a held job shown as waiting for parents")

	page = v.get(t, "/keys")
	require.Regexp(t, `<a href="/keys\?kind=fair%3awork"><bdi>fair:work</bdi></a></td><td>2</td><td>1</td>`, page.body)
	page = v.get(t, "/keys?kind="+url.QueryEscape(tenantWork.Name()))
	require.Regexp(t, `acme &lt;b&gt;&amp;</bdi></td><td>1</td><td>1</td><td>0</td><td>2</td>\s*<td>\d{4}-`, page.body)
	require.Regexp(t, `globex</bdi></td><td>1</td><td>1</td><td>0</td><td>0</td>\s*<td>—</td>`, page.body)
	page = v.get(t, "/keys?kind=nothing")
	require.Contains(t, page.body, `id="no-keys"`)
}

// In a browser: from a held job's page to its key's row.
func TestBrowserKeysPage(t *testing.T) {
	needChromium(t)
	b := setupAlone(t, nil)
	held := b.flood(t, "acme", 3)
	ctx := newBrowser(t)
	signInBrowser(t, ctx, b.ts.URL, viewerName, viewerPassword, "/jobs/"+held.Job.ID)
	run(t, ctx, chromedp.WaitVisible(chromedp.ID("concurrency-key")))
	require.Equal(t, "waiting", text(t, ctx, "#status"))
	require.Equal(t, "held", text(t, ctx, "#held"))
	noCSPViolations(t, ctx, "a held job's page")
	run(t, ctx, chromedp.Click(chromedp.ID("key-link")), chromedp.WaitVisible(chromedp.ID("keys")))
	require.Equal(t, 1, eval[int](t, ctx, `document.querySelectorAll('#keys tbody tr').length`))
	require.Equal(t, "2", eval[string](t, ctx, `document.querySelector('#keys tbody tr td:nth-child(5)').textContent`))
	noCSPViolations(t, ctx, "the keys page")
	run(t, ctx, chromedp.EmulateViewport(390, 900), chromedp.Reload(), chromedp.WaitVisible(chromedp.ID("keys")))
	noPageOverflow(t, ctx, "the keys page")
}
