package web_test

import (
	"context"
	"net/http"
	"net/url"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/tasks"
	"github.com/keeljobs/keel/web"
)

// ledgerJob enqueues a job and sets its ledger row as the test needs.
func (b *bundle) ledgerJob(t *testing.T, kind, key string, set string, args ...any) idempotency.Job {
	t.Helper()
	res, err := b.client.Enqueue(context.Background(), tasks.NewRaw(kind, []byte(`{"order":"`+key+`"}`), key))
	require.NoError(t, err)
	if set != "" {
		_, err = b.pool.Exec(context.Background(), `UPDATE keel_jobs SET `+set+` WHERE id = $1`, append([]any{res.Job.ID}, args...)...)
		require.NoError(t, err)
	}
	return res.Job
}

var rowID = regexp.MustCompile(`<tr id="row-([^"]+)"`)

// listed returns the ids of the jobs a jobs-list page shows, in order.
func listed(t *testing.T, u *user, path string) []string {
	t.Helper()
	res := u.get(t, path)
	require.Equal(t, http.StatusOK, res.status, res.body)
	var ids []string
	for _, m := range rowID.FindAllStringSubmatch(res.body, -1) {
		ids = append(ids, m[1])
	}
	return ids
}

func TestJobsListFilters(t *testing.T) {
	b := setup(t, nil)
	pending := b.ledgerJob(t, "order:send_receipt", "order:1", "")
	succeeded := b.ledgerJob(t, "order:send_receipt", "order:2",
		`status = 'succeeded', finished_at = now(), last_error = 'SMTP timeout on attempt 1'`)
	dead := b.deadJob(t, "order:send_receipt", "order:3", "card DECLINED by the bank")
	failed := b.ledgerJob(t, "analytics:sync", "day:1", `status = 'failed', attempts = 1, last_error = 'warehouse busy', queue = 'low'`)
	deadStep := b.deadJob(t, "order:refund", "refund:1", "payment provider unreachable")
	deadText := b.deadJob(t, "order:refund", "refund:2", `keel: step "charge" of job x: `+idempotency.ErrInDoubt.Error())
	failedStep := b.ledgerJob(t, "order:refund", "refund:3", `status = 'failed', last_error = 'timeout'`)
	running := b.ledgerJob(t, "order:refund", "refund:4", `status = 'running', lease_holder = 'w1', lease_until = now() + interval '1 minute'`)
	// As the guard records a death in doubt whose step record is gone.
	_, err := b.pool.Exec(t.Context(), `UPDATE keel_jobs SET in_doubt = true WHERE id = $1`, deadText.ID)
	require.NoError(t, err)
	for _, id := range []string{deadStep.ID, failedStep.ID, running.ID} {
		_, err := b.pool.Exec(t.Context(), `INSERT INTO keel_steps (job_id, name, status) VALUES ($1, 'charge', 'started')`, id)
		require.NoError(t, err)
	}
	v := b.signIn(t, viewerName, viewerPassword)

	all := []string{running.ID, failedStep.ID, deadText.ID, deadStep.ID, failed.ID, dead.ID, succeeded.ID, pending.ID}
	require.Equal(t, all, listed(t, v, "/jobs"), "every job, newest first")
	require.Equal(t, []string{dead.ID, deadStep.ID, deadText.ID}, listed(t, v, "/jobs?status=dead&sort=oldest"))
	require.Equal(t, []string{succeeded.ID}, listed(t, v, "/jobs?status=succeeded"))
	require.Equal(t, []string{failed.ID}, listed(t, v, "/jobs?queue=low"))
	require.Equal(t, []string{failed.ID}, listed(t, v, "/jobs?kind=analytics:sync"))
	require.Equal(t, []string{running.ID, failedStep.ID, deadText.ID, deadStep.ID}, listed(t, v, "/jobs?kind=order:refund&prefix=refund:"))
	require.Equal(t, []string{succeeded.ID, pending.ID}, listed(t, v, "/jobs?prefix=order:&status=&kind=order:send_receipt&error=&sort=newest")[1:])
	require.Equal(t, []string{dead.ID}, listed(t, v, "/jobs?error=declined"), "error text, any case")
	require.Equal(t, []string{failedStep.ID, deadText.ID, deadStep.ID}, listed(t, v, "/jobs?status=in-doubt"),
		"a running job's started step is a call in progress, not in doubt")
	require.Empty(t, listed(t, v, "/jobs?prefix=%25"), "the prefix is text, not a pattern")
	// A job its kind's pause holds, and a cancelled one whose call had left,
	// keep their steps in doubt too.
	paused := b.ledgerJob(t, "order:refund", "refund:5", `status = 'paused'`)
	cancelled := b.ledgerJob(t, "order:refund", "refund:6", `status = 'cancelled', finished_at = now()`)
	for _, id := range []string{paused.ID, cancelled.ID} {
		_, err := b.pool.Exec(t.Context(), `INSERT INTO keel_steps (job_id, name, status) VALUES ($1, 'charge', 'started')`, id)
		require.NoError(t, err)
	}
	require.Equal(t, []string{cancelled.ID, paused.ID, failedStep.ID, deadText.ID, deadStep.ID}, listed(t, v, "/jobs?status=in-doubt"))

	for _, bad := range []string{"/jobs?status=lost", "/jobs?sort=sideways", "/jobs?refresh=7"} {
		require.Equal(t, http.StatusBadRequest, v.get(t, bad).status, bad)
	}

	// A succeeded job's error is history, not shown as a failure.
	page := v.get(t, "/jobs?status=succeeded").body
	require.Contains(t, page, `<span class="err-old">earlier: SMTP timeout on attempt 1</span>`)
	require.Contains(t, v.get(t, "/jobs?status=dead").body, `<span class="err-now">card DECLINED by the bank</span>`)
	page = v.get(t, "/jobs/"+succeeded.ID).body
	require.Contains(t, page, "Earlier error")
	require.NotContains(t, page, `class="err"`)
	require.Contains(t, v.get(t, "/jobs/"+dead.ID).body, `<pre class="err" id="last-error">`)
}

func TestJobsListPagesByKeyset(t *testing.T) {
	b := setup(t, func(c *web.Config) { c.PageSize = 2 })
	var ids []string
	for _, k := range []string{"a", "b", "c", "d", "e"} {
		ids = append([]string{b.ledgerJob(t, "order:send_receipt", "order:"+k, "").ID}, ids...)
	}
	v := b.signIn(t, viewerName, viewerPassword)
	res := v.get(t, "/jobs")
	require.Equal(t, ids[:2], listed(t, v, "/jobs"))
	next := regexp.MustCompile(`href="(/jobs\?from=[^"]+)" rel="next"`).FindStringSubmatch(res.body)
	require.NotNil(t, next, "a link to the next page")
	nextURL := strings.ReplaceAll(next[1], "&amp;", "&")
	// A job enqueued meanwhile does not shift the next page.
	b.ledgerJob(t, "order:send_receipt", "order:f", "")
	require.Equal(t, ids[2:4], listed(t, v, nextURL))
	last := v.get(t, "/jobs?from="+url.QueryEscape(ids[3]))
	require.Equal(t, ids[4:], rowID.FindAllStringSubmatch(last.body, -1)[0][1:])
	require.NotContains(t, last.body, `rel="next"`)
	require.Contains(t, last.body, `id="first-page"`)
}

func TestJobsListRefreshesWithoutScript(t *testing.T) {
	b := setup(t, nil)
	v := b.signIn(t, viewerName, viewerPassword)
	require.NotContains(t, v.get(t, "/jobs").body, `http-equiv="refresh"`)
	res := v.get(t, "/jobs?status=running&refresh=10")
	require.Contains(t, res.body, `<meta http-equiv="refresh" content="10">`)
	require.NotContains(t, res.header.Get("Content-Security-Policy"), "script-src")
	require.NotContains(t, res.body, "<script")
}

func TestPayloadIsShownReadably(t *testing.T) {
	b := setup(t, nil)
	res, err := b.client.Enqueue(t.Context(), tasks.NewRaw(plainKind.Name(),
		[]byte(`{"note":"\u003cb\u003e \u0026 \\u003c","items":[1,2]}`), "order:1"))
	require.NoError(t, err)
	body := b.signIn(t, viewerName, viewerPassword).get(t, "/jobs/"+res.Job.ID).body
	require.Contains(t, body, "{\n  &#34;note&#34;: &#34;&lt;b&gt; &amp; \\\\u003c&#34;,\n  &#34;items&#34;: [\n    1,")
	require.NotContains(t, body, `\u003cb`)
}

func TestBulkActionsOnSelectedJobs(t *testing.T) {
	b := setup(t, nil)
	d1 := b.deadJob(t, "order:send_receipt", "order:1", "boom")
	d2 := b.deadJob(t, "order:send_receipt", "order:2", "boom")
	d3 := b.deadJob(t, "order:send_receipt", "order:3", "boom")
	pending := b.ledgerJob(t, "order:send_receipt", "order:4", "")
	op := b.signIn(t, operatorName, operatorPassword)
	tok := op.token(t)

	list := op.get(t, "/jobs").body
	require.Contains(t, list, `<input type="checkbox" name="id" value="`+d1.ID+`"`)
	require.Contains(t, list, `<input type="checkbox" name="id" value="`+pending.ID+`"`, "a pending job can be selected to cancel")
	done := b.ledgerJob(t, "order:send_receipt", "order:5", "")
	_, err := b.pool.Exec(t.Context(), `UPDATE keel_jobs SET status = 'succeeded' WHERE id = $1`, done.ID)
	require.NoError(t, err)
	require.NotContains(t, op.get(t, "/jobs").body, `value="`+done.ID+`"`, "a finished job cannot be selected")
	require.NotContains(t, b.signIn(t, viewerName, viewerPassword).get(t, "/jobs").body, `type="checkbox"`)

	sel := url.Values{"action": {"discard"}, "id": {d1.ID, d2.ID, pending.ID}}
	res := op.get(t, "/dead/confirm?"+sel.Encode())
	require.Equal(t, http.StatusOK, res.status, res.body)
	require.Contains(t, res.body, "Of the 3 jobs you selected, 2 are dead now")
	require.Contains(t, res.body, `name="expect" value="2"`)

	form := url.Values{"csrf": {tok}, "action": {"discard"}, "id": sel["id"], "expect": {"2"}, "note": {"duplicates"}}
	// Someone replays one of them meanwhile: the confirmed count is stale.
	_, err = b.ops.Replay(t.Context(), d2.ID, "someone", "")
	require.NoError(t, err)
	res = op.post(t, "/dead/bulk", form)
	require.Equal(t, http.StatusConflict, res.status)
	require.Contains(t, res.body, `name="expect" value="1"`)
	form.Set("expect", "1")
	res = op.post(t, "/dead/bulk", form)
	require.Equal(t, http.StatusOK, res.status, res.body)
	require.Contains(t, res.body, "1 of 1 done")
	for id, want := range map[string]idempotency.Status{d1.ID: idempotency.StatusDiscarded, d2.ID: idempotency.StatusPending,
		d3.ID: idempotency.StatusDead, pending.ID: idempotency.StatusPending} {
		j, err := b.store.Get(t.Context(), id)
		require.NoError(t, err)
		require.Equal(t, want, j.Status, id)
	}
	require.Equal(t, "duplicates", b.audit(t, d1.ID)[0].Note)
}

// A job on the relay's outbox is the relay's next, though its row is marked
// published; once in Redis, any worker's.
func TestJobPageSaysWhoHandlesAPendingJobNext(t *testing.T) {
	b := setup(t, nil)
	ctx := t.Context()
	tx, err := b.pool.Begin(ctx)
	require.NoError(t, err)
	res, err := b.client.EnqueueTx(ctx, tx, tasks.NewRaw("order:send_receipt", []byte(`{"order":"o-1"}`), "order:o-1"))
	require.NoError(t, err)
	require.NoError(t, tx.Commit(ctx))
	id := res.Job.ID
	v := b.signIn(t, viewerName, viewerPassword)
	require.Contains(t, v.get(t, "/jobs/"+id).body, "Waiting for the relay to hand it to Redis")

	published, err := b.client.Enqueue(ctx, tasks.NewRaw("order:send_receipt", []byte(`{"order":"o-2"}`), "order:o-2"))
	require.NoError(t, err)
	require.True(t, published.Published)
	require.Contains(t, v.get(t, "/jobs/"+published.Job.ID).body, "In Redis, waiting for any worker")

	// One that runs later says when, not that the workers keep it waiting.
	later, err := b.client.Enqueue(ctx, tasks.NewRaw("order:send_receipt", []byte(`{"order":"o-3"}`), "order:o-3", tasks.Delay(30*time.Minute)))
	require.NoError(t, err)
	page := v.get(t, "/jobs/"+later.Job.ID).body
	// Its id in another UUID spelling leads to its page.
	moved := v.get(t, "/jobs/"+strings.ToUpper(later.Job.ID))
	require.Equal(t, http.StatusMovedPermanently, moved.status)
	require.Equal(t, "/jobs/"+later.Job.ID, moved.header.Get("Location"))
	require.Contains(t, page, "Runs at "+later.Job.RunAt.UTC().Format("2006-01-02 15:04:05 UTC"))
	require.NotContains(t, page, "In Redis, waiting for any worker")
}

// The look-up finds a job by its business key as the ledger keeps it, spaces
// around it included (a key may carry them), and still finds a key pasted
// with stray spaces when no key has them.
func TestLookupFindsAKeyWithItsSpaces(t *testing.T) {
	b := setup(t, nil)
	padded := b.deadJob(t, "order:send_receipt", " order:7 ", "boom")
	plain := b.deadJob(t, "order:send_receipt", "order:8", "boom")
	v := b.signIn(t, viewerName, viewerPassword)
	for key, want := range map[string]string{" order:7 ": padded.ID, "order:8": plain.ID, "  order:8\t": plain.ID} {
		res := v.get(t, "/jobs?kind=order:send_receipt&key="+url.QueryEscape(key))
		require.Equal(t, http.StatusSeeOther, res.status, "key %q: %s", key, res.body)
		require.Equal(t, "/jobs/"+want, res.header.Get("Location"), "key %q", key)
	}
	res := v.get(t, "/jobs?kind=order:send_receipt&key="+url.QueryEscape("order:7"))
	require.Equal(t, http.StatusNotFound, res.status, "a key without its spaces is another key")
}

// A replay of jobs ticked on the jobs list warns, as one by filter does, of
// those it will refuse (a step in doubt, effects committed): the count to
// confirm is not the count that will run.
func TestReplayOfSelectedJobsSaysWhichItRefuses(t *testing.T) {
	b := setup(t, nil)
	ok := b.deadJob(t, "order:send_receipt", "order:1", "boom")
	doubt := b.deadJob(t, "order:send_receipt", "order:2", "in doubt")
	_, err := b.pool.Exec(t.Context(), `INSERT INTO keel_steps (job_id, name, status) VALUES ($1, 'mail', 'started')`, doubt.ID)
	require.NoError(t, err)
	op := b.signIn(t, operatorName, operatorPassword)
	sel := url.Values{"action": {"replay"}, "id": {ok.ID, doubt.ID}}
	res := op.get(t, "/dead/confirm?"+sel.Encode())
	require.Equal(t, http.StatusOK, res.status, res.body)
	require.Contains(t, res.body, `<p class="warn" id="refused">1 of them cannot be replayed`)
	sel.Set("action", "discard")
	require.NotContains(t, op.get(t, "/dead/confirm?"+sel.Encode()).body, `id="refused"`, "a discard refuses none of them")
}

// A failed job's next step does not promise the kind's whole budget when its
// error is unclassified: the worker's policy retries those fewer times (3 by
// default), so "attempt 2 of 9" would be 2 of 4.
func TestJobPageSaysAnUnclassifiedFailureHasAShorterBudget(t *testing.T) {
	b := setup(t, nil)
	unknown := b.ledgerJob(t, "order:send_receipt", "order:1", `status = 'failed', attempts = 2, max_retry = 8,
		error_class = 'unknown', last_error = 'weird', run_at = now() + interval '1 minute'`)
	transient := b.ledgerJob(t, "order:send_receipt", "order:2", `status = 'failed', attempts = 2, max_retry = 8,
		error_class = 'transient', last_error = 'timeout', run_at = now() + interval '1 minute'`)
	v := b.signIn(t, viewerName, viewerPassword)
	page := v.get(t, "/jobs/"+unknown.ID).body
	require.NotContains(t, page, "Failed attempt 2 of 9")
	require.Contains(t, page, "dies after attempt 4")
	require.Contains(t, v.get(t, "/jobs/"+transient.ID).body, "Failed attempt 2 of 9")
}

// A job keel gave an extra run after a crash beside other jobs shows it in
// its budget and in what happens next.
func TestJobPageShowsRunsKeelAddedAfterACrash(t *testing.T) {
	b := setup(t, nil)
	j := b.ledgerJob(t, "order:send_receipt", "order:3", `status = 'failed', attempts = 1, max_retry = 0, extra_runs = 1,
		crashes = 1, error_class = 'transient', last_error = 'timeout', run_at = now() + interval '1 minute'`)
	v := b.signIn(t, viewerName, viewerPassword)
	page := v.get(t, "/jobs/"+j.ID).body
	require.Contains(t, page, "Failed attempt 1 of 2")
	require.Contains(t, page, "1 run(s) keel added because a run crashed beside other jobs")
}

func TestOverlongFilterParametersAreRefusedNotEchoed(t *testing.T) {
	b := setup(t, nil)
	v := b.signIn(t, operatorName, operatorPassword)
	long := strings.Repeat("k", 60<<10)
	for _, path := range []string{
		"/dead?kind=" + long, "/dead?queue=" + long, "/dead?class=" + long, "/dead?since=" + long,
		"/jobs?kind=" + long, "/jobs?kind=" + long + "&key=x", "/jobs?kind=x&key=" + long, "/jobs?id=" + long,
		"/jobs?key=" + long, "/dead/confirm?action=replay&kind=" + long,
	} {
		res := v.get(t, path)
		require.Equal(t, http.StatusBadRequest, res.status, path[:20])
		require.NotContains(t, res.body, strings.Repeat("k", 600), path[:20])
		require.Contains(t, res.body, "at most 512 bytes", path[:20])
	}
}

func TestReplayOfAJobThatNeverDiedSaysSo(t *testing.T) {
	b := setup(t, nil)
	res, err := b.client.Enqueue(t.Context(), tasks.NewRaw("order:send_receipt", []byte(`{}`), "order:9"))
	require.NoError(t, err)
	_, err = b.pool.Exec(t.Context(), `UPDATE keel_jobs SET status = 'succeeded', finished_at = now() WHERE id = $1`, res.Job.ID)
	require.NoError(t, err)
	op := b.signIn(t, operatorName, operatorPassword)
	r := op.post(t, "/jobs/"+res.Job.ID+"/replay", url.Values{"csrf": {op.token(t)}})
	require.Equal(t, http.StatusSeeOther, r.status, r.body)
	page := op.get(t, r.header.Get("Location"))
	require.NotContains(t, page.body, "someone replayed it first")
	require.Contains(t, page.body, "Nothing to do: the job is not dead")

	// One that died and was replayed meanwhile is said to have been.
	j := b.deadJob(t, "order:send_receipt", "order:10", "boom")
	require.Equal(t, http.StatusSeeOther, op.post(t, "/jobs/"+j.ID+"/replay", url.Values{"csrf": {op.token(t)}}).status)
	r = op.post(t, "/jobs/"+j.ID+"/replay", url.Values{"csrf": {op.token(t)}})
	require.Contains(t, op.get(t, r.header.Get("Location")).body, "someone replayed it first")
}
