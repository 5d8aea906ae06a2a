package web_test

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/chromedp/cdproto/page"
	"github.com/chromedp/chromedp"
	"github.com/hibiken/asynq"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/testenv"
	"github.com/keeljobs/keel/retry"
	"github.com/keeljobs/keel/server"
	"github.com/keeljobs/keel/tasks"
	"github.com/keeljobs/keel/web"
)

const chromium = "/usr/bin/chromium"

// needChromium skips the test when Chromium is not installed. scripts/test
// may be installing it while the tests run: it then names in
// KEEL_TEST_BROWSER_READY a file the install writes its exit status to
// when it ends, which this waits for.
func needChromium(t *testing.T) {
	t.Helper()
	if ready := os.Getenv("KEEL_TEST_BROWSER_READY"); ready != "" {
		var status []byte
		testenv.Eventually(t, 10*time.Minute, func() bool {
			var err error
			status, err = os.ReadFile(ready)
			return err == nil && len(status) > 0
		}, "Chromium's install (scripts/services) did not end")
		if s := strings.TrimSpace(string(status)); s != "0" {
			t.Fatalf("installing Chromium failed (exit status %s; scripts/services printed its log)", s)
		}
	}
	if _, err := os.Stat(chromium); err != nil {
		t.Skipf("the browser test needs Chromium at %s (Debian: apt-get install chromium): %v", chromium, err)
	}
}

// xssError is the last error of the jobs the browser test looks at: it must
// show as text and never run.
const xssError = `<script>window.__xss=1</script>`

// recordCSPViolations runs in every page before the page's own code (the
// DevTools protocol puts it there, so keel's CSP does not block it).
const recordCSPViolations = `window.__csp = [];
document.addEventListener('securitypolicyviolation', e => window.__csp.push(e.violatedDirective + ' ' + e.blockedURI));`

// startWorker runs a real keel worker until the test ends.
func startWorker(t *testing.T, b *bundle, mux *tasks.Mux) {
	t.Helper()
	cfg := server.Config{Redis: b.redis, Pool: b.pool, Queues: map[string]int{"default": 1}, Concurrency: 4,
		ShutdownTimeout: 2 * time.Second, Logger: slog.New(slog.DiscardHandler)}
	cfg.Relay.PollInterval = 100 * time.Millisecond
	srv, err := server.New(cfg, mux)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-done)
	})
}

func newBrowser(t *testing.T) context.Context {
	t.Helper()
	profile := t.TempDir() // made before the browser, so removed after it stops
	alloc, cancelAlloc := chromedp.NewExecAllocator(context.Background(),
		chromedp.ExecPath(chromium),
		chromedp.Headless,
		chromedp.NoSandbox,
		chromedp.DisableGPU,
		chromedp.NoFirstRun,
		chromedp.NoDefaultBrowserCheck,
		chromedp.Flag("disable-quic", true),
		chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true),
		chromedp.Flag("disable-dev-shm-usage", true),
		chromedp.Flag("disable-extensions", true),
		chromedp.UserDataDir(profile),
		chromedp.WindowSize(1440, 1000),
	)
	ctx, cancelTab := chromedp.NewContext(alloc)
	t.Cleanup(func() {
		cancelTab()
		cancelAlloc()
	})
	require.NoError(t, chromedp.Do(ctx, chromedp.Func(func(ctx context.Context, _ *chromedp.Target) error {
		_, err := chromedp.Call(ctx, page.AddScriptToEvaluateOnNewDocument,
			page.AddScriptToEvaluateOnNewDocumentParams{Source: recordCSPViolations})
		return err
	})), "starting %s", chromium)
	return ctx
}

// run runs browser steps with a deadline, so a page that never shows what a
// step waits for fails the test instead of hanging it.
func run(t *testing.T, ctx context.Context, steps ...chromedp.Action[chromedp.Void]) {
	t.Helper()
	tctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	require.NoError(t, chromedp.Do(tctx, steps...))
}

func eval[T any](t *testing.T, ctx context.Context, expr string, opts ...chromedp.EvaluateOption) T {
	t.Helper()
	tctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	v, err := chromedp.Run(tctx, chromedp.Evaluate[T](expr, opts...))
	require.NoError(t, err, expr)
	return v
}

// waitJS waits until expr is true in the page; a page still navigating
// counts as not yet.
func waitJS(t *testing.T, ctx context.Context, expr, msg string) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	var last error
	for time.Now().Before(deadline) {
		tctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		ok, err := chromedp.Run(tctx, chromedp.Evaluate[bool](expr))
		cancel()
		if err == nil && ok {
			return
		}
		last = err
		time.Sleep(100 * time.Millisecond)
	}
	t.Fatalf("%s (last error: %v)", msg, last)
}

func text(t *testing.T, ctx context.Context, css string) string {
	t.Helper()
	tctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	s, err := chromedp.Run(tctx, chromedp.Text(chromedp.CSS(css), chromedp.NodeVisible))
	require.NoError(t, err, css)
	return s
}

func noCSPViolations(t *testing.T, ctx context.Context, where string) {
	t.Helper()
	require.Empty(t, eval[[]string](t, ctx, `window.__csp || []`), "CSP violations on %s", where)
}

// screenshot saves the page into dir, and into KEEL_WEB_SCREENSHOT_DIR when
// set (CI keeps it as an artifact).
func screenshot(t *testing.T, ctx context.Context, dir, name string) {
	t.Helper()
	tctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	png, err := chromedp.Run(tctx, chromedp.FullScreenshot(100))
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(dir, name), png, 0o644))
	if extra := os.Getenv("KEEL_WEB_SCREENSHOT_DIR"); extra != "" {
		require.NoError(t, os.WriteFile(filepath.Join(extra, name), png, 0o644))
	}
}

func signInBrowser(t *testing.T, ctx context.Context, base, name, password, next string) {
	t.Helper()
	run(t, ctx,
		chromedp.Navigate(base+"/login?next="+next),
		chromedp.WaitVisible(chromedp.ID("name")),
		chromedp.SendKeys(chromedp.ID("name"), name),
		chromedp.SendKeys(chromedp.ID("password"), password),
		chromedp.Click(chromedp.ID("signin")),
	)
}

func TestBrowser(t *testing.T) {
	needChromium(t)
	b := setupAlone(t, nil)
	shots := t.TempDir()

	// A real worker whose handler fails permanently until told otherwise.
	var failing atomic.Bool
	failing.Store(true)
	mux := tasks.NewMux()
	mux.HandleTask("order:send_receipt", asynq.HandlerFunc(func(ctx context.Context, _ *asynq.Task) error {
		if err := idempotency.Progress(ctx, 3, 4, "mailing <b>"); err != nil {
			return err
		}
		if failing.Load() {
			return retry.Permanent(errors.New(xssError))
		}
		return idempotency.SetResult(ctx, map[string]string{"mail_id": "m-1", "html": "<i>sent</i>"})
	}))
	startWorker(t, b, mux)
	var jobs []idempotency.Job
	for _, key := range []string{"order:1", "order:2", "order:3", "order:4"} {
		res, err := b.client.Enqueue(context.Background(), tasks.NewRaw("order:send_receipt", []byte(`{"order_id":"`+key+`"}`), key))
		require.NoError(t, err)
		jobs = append(jobs, res.Job)
	}
	waitStatus := func(id string, want idempotency.Status) {
		testenv.Eventually(t, 15*time.Second, func() bool {
			j, err := b.store.Get(context.Background(), id)
			require.NoError(t, err)
			return j.Status == want
		}, "job %s never became %s", id, want)
	}
	for _, j := range jobs {
		waitStatus(j.ID, idempotency.StatusDead)
	}
	replayed, discarded, untouched, handedOver := jobs[0], jobs[1], jobs[2], jobs[3]

	ctx := newBrowser(t)
	base := b.ts.URL

	// The operator signs in and lands on the overview.
	signInBrowser(t, ctx, base, operatorName, operatorPassword, "/")
	run(t, ctx, chromedp.WaitVisible(chromedp.ID("dead-total")))
	require.Equal(t, "4", text(t, ctx, "#dead-total"))
	require.Contains(t, text(t, ctx, "table.queues"), "default")
	// Two samples a second apart draw the charts.
	run(t, ctx, chromedp.Sleep(2200*time.Millisecond), chromedp.Reload(), chromedp.WaitVisible(chromedp.CSS("svg.chart")))
	screenshot(t, ctx, shots, "overview.png")
	noCSPViolations(t, ctx, "the overview")

	// Dead letters: the error is shown as text and does not run.
	run(t, ctx, chromedp.Navigate(base+"/dead"), chromedp.WaitVisible(chromedp.CSS("#job-"+replayed.ID)))
	require.Equal(t, xssError, text(t, ctx, "#job-"+replayed.ID+" summary"))
	run(t, ctx, chromedp.Click(chromedp.CSS("#job-"+replayed.ID+" summary")), chromedp.WaitVisible(chromedp.CSS("#job-"+replayed.ID+" pre.err")))
	require.Equal(t, xssError, text(t, ctx, "#job-"+replayed.ID+" pre.err"))
	require.True(t, eval[bool](t, ctx, `window.__xss === undefined`), "the job's error ran as script")
	require.Equal(t, 0, eval[int](t, ctx, `document.querySelectorAll('main script').length`))
	screenshot(t, ctx, shots, "dead.png")
	noCSPViolations(t, ctx, "the dead letters")

	// Found by its business key from the overview's look-up form, as the
	// operator asked about it: "what state is order 1's receipt in?".
	run(t, ctx, chromedp.Navigate(base+"/"), chromedp.WaitVisible(chromedp.CSS("section.lookup")),
		chromedp.SendKeys(chromedp.CSS(`section.lookup input[name="kind"]`), "order:send_receipt"),
		chromedp.SendKeys(chromedp.CSS(`section.lookup input[name="key"]`), "order:1"),
		chromedp.Submit(chromedp.CSS(`section.lookup input[name="key"]`)),
		chromedp.WaitVisible(chromedp.ID("replay")))
	require.Equal(t, "dead", text(t, ctx, "#status"))
	require.Contains(t, eval[string](t, ctx, `document.location.toString()`), replayed.ID, "the look-up should open the job's page")

	// Its page from the dead letters, then replay: the handler now succeeds.
	run(t, ctx, chromedp.Navigate(base+"/dead"), chromedp.WaitVisible(chromedp.CSS("#job-"+replayed.ID)))
	run(t, ctx, chromedp.Click(chromedp.CSS("#job-"+replayed.ID+" a.key")), chromedp.WaitVisible(chromedp.ID("replay")))
	require.Equal(t, "dead", text(t, ctx, "#status"))
	require.Equal(t, xssError, text(t, ctx, "#last-error"))
	require.True(t, eval[bool](t, ctx, `window.__xss === undefined`))
	screenshot(t, ctx, shots, "job.png")
	failing.Store(false)
	run(t, ctx, chromedp.Click(chromedp.ID("replay")), chromedp.WaitVisible(chromedp.CSS("p.flash")))
	require.Contains(t, text(t, ctx, "p.flash"), "Replayed")
	require.Contains(t, text(t, ctx, "table.audit"), "replay")
	waitStatus(replayed.ID, idempotency.StatusSucceeded)
	run(t, ctx, chromedp.Reload(), chromedp.WaitVisible(chromedp.ID("status")))
	require.Equal(t, "succeeded", text(t, ctx, "#status"))
	// What its handler reported and stored, shown as text.
	require.Contains(t, text(t, ctx, "#progress"), "3/4 (75%)")
	require.Equal(t, "mailing <b>", text(t, ctx, "#progress-note"))
	require.Contains(t, text(t, ctx, "#progress"), "last reported")
	require.Equal(t, 75, eval[int](t, ctx, `document.querySelector('#progress progress').value`))
	require.JSONEq(t, `{"mail_id": "m-1", "html": "<i>sent</i>"}`, text(t, ctx, "#result"))
	require.Equal(t, 0, eval[int](t, ctx, `document.querySelectorAll('#result i, #progress b').length`), "job text became markup")

	// Discard another with a note; the audit entry is on its page.
	run(t, ctx,
		chromedp.Navigate(base+"/jobs/"+discarded.ID),
		chromedp.WaitVisible(chromedp.ID("discard-note")),
		chromedp.SendKeys(chromedp.ID("discard-note"), "customer cancelled order 2"),
		chromedp.Click(chromedp.ID("discard")),
		chromedp.WaitVisible(chromedp.CSS("table.audit")),
	)
	require.Equal(t, "discarded", text(t, ctx, "#status"))
	audit := text(t, ctx, "table.audit")
	require.Contains(t, audit, "discard")
	require.Contains(t, audit, operatorName)
	require.Contains(t, audit, "customer cancelled order 2")
	noCSPViolations(t, ctx, "a job page")

	// The operator's asynqmon is writable, and the browser's own fetch calls
	// pass the same-origin check.
	run(t, ctx, chromedp.Navigate(base+"/monitoring/"))
	waitJS(t, ctx, `(() => { const r = document.querySelector('#root'); return !!r && r.innerText.includes('default') })()`,
		"asynqmon's app did not render the queue list")
	require.True(t, eval[bool](t, ctx, `window.FLAG_READ_ONLY === "false"`))
	for _, action := range []string{"pause", "resume"} {
		status := eval[int](t, ctx, `fetch('/monitoring/api/queues/default:`+action+`', {method: 'POST'}).then(r => r.status)`, chromedp.EvalAwaitPromise)
		require.Equal(t, 204, status, action)
	}
	noCSPViolations(t, ctx, "asynqmon")
	// Nothing comes from another site, and a link leads back to keel.
	require.True(t, eval[bool](t, ctx, `performance.getEntriesByType('resource').every(e => e.name.startsWith(location.origin))`),
		"asynqmon loaded something from another site")
	require.Equal(t, "/", eval[string](t, ctx, `document.querySelector('#keel-back').getAttribute('href')`))
	// asynqmon's "run" of the archived task is keel's replay: the ledger
	// hands the job back to the worker, which now succeeds.
	status := eval[int](t, ctx, `fetch('/monitoring/api/queues/default/archived_tasks/`+handedOver.ID+`:run', {method: 'POST'}).then(r => r.status)`, chromedp.EvalAwaitPromise)
	require.Equal(t, 204, status)
	waitStatus(handedOver.ID, idempotency.StatusSucceeded)
	require.Equal(t, "replay", b.audit(t, handedOver.ID)[0].Action)

	// The viewer sees the dead job but has no replay button, and a forged
	// replay is refused.
	run(t, ctx, chromedp.Navigate(base+"/"), chromedp.Click(chromedp.ID("logout")), chromedp.WaitVisible(chromedp.ID("signin")))
	signInBrowser(t, ctx, base, viewerName, viewerPassword, "/jobs/"+untouched.ID)
	run(t, ctx, chromedp.WaitVisible(chromedp.ID("status")))
	require.Equal(t, "dead", text(t, ctx, "#status"))
	require.True(t, eval[bool](t, ctx, `document.querySelector('#replay') === null && document.querySelector('#discard') === null`))
	// keel's CSP allows no fetch from its pages, so forge a form post.
	run(t, ctx,
		chromedp.Evaluate[chromedp.Void](`(() => {
			const f = document.createElement('form');
			f.method = 'post';
			f.action = '/jobs/`+untouched.ID+`/replay';
			const i = document.createElement('input');
			i.name = 'csrf';
			i.value = document.querySelector('input[name=csrf]').value;
			f.appendChild(i);
			document.body.appendChild(f);
			f.submit();
		})()`),
	)
	waitJS(t, ctx, `document.body.innerText.includes('operators only')`, "the forged replay was not refused")
	j, err := b.store.Get(context.Background(), untouched.ID)
	require.NoError(t, err)
	require.Equal(t, idempotency.StatusDead, j.Status)

	// asynqmon loads under /monitoring/ and lists the queue (its API answers
	// through keel's sign-in); its writes are refused for viewers.
	run(t, ctx, chromedp.Navigate(base+"/monitoring/"))
	waitJS(t, ctx, `(() => { const r = document.querySelector('#root'); return !!r && r.children.length > 0 && r.innerText.includes('default') })()`,
		"asynqmon's app did not render the queue list")
	require.True(t, eval[bool](t, ctx, `window.FLAG_READ_ONLY === "true"`))
	noCSPViolations(t, ctx, "asynqmon")
	status = eval[int](t, ctx, `fetch('/monitoring/api/queues/default:pause', {method: 'POST'}).then(r => r.status)`, chromedp.EvalAwaitPromise)
	require.Equal(t, 403, status)
	screenshot(t, ctx, shots, "monitoring.png")
	for _, name := range []string{"overview.png", "dead.png", "job.png", "monitoring.png"} {
		st, err := os.Stat(filepath.Join(shots, name))
		require.NoError(t, err)
		require.Greater(t, st.Size(), int64(10_000), name)
	}
	require.False(t, strings.Contains(eval[string](t, ctx, `document.body.innerText`), "Refused"))
}

func TestBrowserJobsList(t *testing.T) {
	needChromium(t)
	b := setupAlone(t, nil)
	shots := t.TempDir()
	dead1 := b.deadJob(t, "order:send_receipt", "order:1", "card declined")
	dead2 := b.deadJob(t, "order:send_receipt", "order:2", "card declined")
	dead3 := b.deadJob(t, "order:send_receipt", "order:3", "card declined")
	done, err := b.client.Enqueue(context.Background(), tasks.NewRaw("order:send_receipt", []byte(`{"note":"\u003cb\u003ebold\u003c/b\u003e \u0026 co"}`), "order:4"))
	require.NoError(t, err)
	_, err = b.pool.Exec(context.Background(), `UPDATE keel_jobs SET status = 'succeeded', last_error = 'SMTP timeout' WHERE id = $1`, done.Job.ID)
	require.NoError(t, err)
	pending, err := b.client.Enqueue(context.Background(), tasks.NewRaw("analytics:sync", []byte(`{}`), "day:1"))
	require.NoError(t, err)

	ctx := newBrowser(t)
	base := b.ts.URL
	signInBrowser(t, ctx, base, operatorName, operatorPassword, "/jobs")
	run(t, ctx, chromedp.WaitVisible(chromedp.ID("jobs")))
	require.Equal(t, 5, eval[int](t, ctx, `document.querySelectorAll('#jobs tbody tr').length`))
	// The succeeded job's old error is grey history, not a red failure.
	require.Equal(t, "earlier: SMTP timeout", text(t, ctx, "#row-"+done.Job.ID+" .err-old"))
	require.NotEqual(t, eval[string](t, ctx, `getComputedStyle(document.querySelector('#row-`+dead1.ID+` .err-now')).color`),
		eval[string](t, ctx, `getComputedStyle(document.querySelector('#row-`+done.Job.ID+` .err-old')).color`))
	screenshot(t, ctx, shots, "jobs.png")
	noCSPViolations(t, ctx, "the jobs list")

	// Filter to the dead through the form.
	run(t, ctx,
		chromedp.SetValue(chromedp.ID("f-status"), "dead"),
		chromedp.Click(chromedp.ID("f-apply")),
	)
	waitJS(t, ctx, `document.location.search.includes('status=dead') && !!document.querySelector('#selected-discard')`,
		"the filter form did not show the dead jobs")
	require.Equal(t, 3, eval[int](t, ctx, `document.querySelectorAll('#jobs tbody tr').length`))
	require.Equal(t, 0, eval[int](t, ctx, `document.querySelectorAll('#row-`+pending.Job.ID+`').length`))

	// Select two and discard them through the confirmed count.
	run(t, ctx,
		chromedp.Click(chromedp.CSS(`#row-`+dead1.ID+` input[type=checkbox]`)),
		chromedp.Click(chromedp.CSS(`#row-`+dead2.ID+` input[type=checkbox]`)),
		chromedp.Click(chromedp.ID("selected-discard")),
		chromedp.WaitVisible(chromedp.ID("confirm")),
	)
	require.Contains(t, text(t, ctx, "main"), "Of the 2 jobs you selected, 2 are dead now")
	run(t, ctx,
		chromedp.SendKeys(chromedp.CSS(`textarea[name="note"]`), "duplicate orders"),
		chromedp.Click(chromedp.ID("confirm")),
	)
	waitJS(t, ctx, `(document.querySelector('main h1') || {innerText: ''}).innerText.startsWith('Bulk discard')`,
		"the bulk discard's result did not show")
	require.Equal(t, "Bulk discard: 2 of 2 done", text(t, ctx, "main h1"))
	for id, want := range map[string]idempotency.Status{dead1.ID: idempotency.StatusDiscarded, dead2.ID: idempotency.StatusDiscarded,
		dead3.ID: idempotency.StatusDead} {
		j, err := b.store.Get(context.Background(), id)
		require.NoError(t, err)
		require.Equal(t, want, j.Status)
	}

	// A bulk action by filter still running when its request stops waiting
	// goes on in the background, on a page that refreshes itself until done.
	web.SetBulkInlineWait(t, 0)
	run(t, ctx, chromedp.Navigate(base+"/dead/confirm?action=discard&kind=order:send_receipt"), chromedp.WaitVisible(chromedp.ID("confirm")))
	run(t, ctx,
		chromedp.SendKeys(chromedp.CSS(`textarea[name="note"]`), "one more"),
		chromedp.Click(chromedp.ID("confirm")),
	)
	waitJS(t, ctx, `document.location.pathname.startsWith('/bulk/') &&
		(document.querySelector('main h1') || {innerText: ''}).innerText === 'Bulk discard: 1 of 1 done'`,
		"the bulk discard's progress page did not show it done")
	noCSPViolations(t, ctx, "the bulk action's progress page")
	j3, err := b.store.Get(context.Background(), dead3.ID)
	require.NoError(t, err)
	require.Equal(t, idempotency.StatusDiscarded, j3.Status)

	// The payload of a kind this program does not declare is hidden until
	// the operator asks; then it reads as JSON, with < as <.
	run(t, ctx, chromedp.Navigate(base+"/jobs/"+done.Job.ID), chromedp.WaitVisible(chromedp.ID("payload-hidden")))
	require.Equal(t, 0, eval[int](t, ctx, `document.querySelectorAll('pre.payload').length`))
	run(t, ctx, chromedp.Click(chromedp.ID("show-payload")), chromedp.WaitVisible(chromedp.CSS("pre.payload")))
	require.Equal(t, "show-payload", b.audit(t, done.Job.ID)[0].Action)
	require.Equal(t, "{\n  \"note\": \"<b>bold</b> & co\"\n}", text(t, ctx, "pre.payload"))
	require.Equal(t, 0, eval[int](t, ctx, `document.querySelectorAll('pre.payload b').length`))

	// Auto refresh works under the script-free policy: the page reloads.
	run(t, ctx, chromedp.Navigate(base+"/jobs?status=dead&refresh=5"), chromedp.WaitVisible(chromedp.ID("jobs")))
	run(t, ctx, chromedp.Evaluate[chromedp.Void](`window.__before_reload = 1`))
	waitJS(t, ctx, `window.__before_reload === undefined && !!document.querySelector('#jobs')`, "the jobs list did not refresh itself")
	require.Contains(t, eval[string](t, ctx, `document.location.search`), "refresh=5")
	noCSPViolations(t, ctx, "the refreshed jobs list")
}
