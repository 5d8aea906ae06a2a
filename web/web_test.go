package web_test

import (
	"encoding/base64"
	"net/http"
	"net/url"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/crypto/bcrypt"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/inspect"
	"github.com/keeljobs/keel/web"
)

func TestAnonymousGetsNothingButHealthz(t *testing.T) {
	b := setup(t, nil)
	j := b.deadJob(t, "order:send_receipt", "order:1", "boom")
	anon := b.anonymous()

	res := anon.get(t, "/healthz")
	require.Equal(t, http.StatusOK, res.status)

	pages := []string{"/", "/dead", "/dead?kind=x", "/jobs", "/jobs?kind=order:send_receipt&key=order:1", "/jobs/" + j.ID,
		"/dead/confirm?action=replay", "/monitoring", "/monitoring/", "/monitoring/queues/default",
		"/monitoring/static/js/main.5adda2da.chunk.js", "/favicon.ico", "/nonexistent"}
	for _, p := range pages {
		res := anon.get(t, p)
		require.Equal(t, http.StatusFound, res.status, p)
		loc, err := url.Parse(res.header.Get("Location"))
		require.NoError(t, err)
		require.Equal(t, "/login", loc.Path, p)
		require.Equal(t, p, loc.Query().Get("next"), p)
	}
	for _, p := range []string{"/metrics", "/monitoring/api/queues", "/monitoring/api/queues/default", "/monitoring/api/redis_info"} {
		require.Equal(t, http.StatusUnauthorized, anon.get(t, p).status, p)
	}
	writes := []struct{ method, path string }{
		{"POST", "/jobs/" + j.ID + "/replay"},
		{"POST", "/jobs/" + j.ID + "/discard"},
		{"POST", "/jobs/" + j.ID + "/resolve"},
		{"POST", "/dead/bulk"},
		{"POST", "/logout"},
		{"POST", "/monitoring/api/queues/default:pause"},
		{"DELETE", "/monitoring/api/queues/default"},
		{"DELETE", "/monitoring/api/queues/default/pending_tasks/" + j.ID},
		{"POST", "/healthz"},
	}
	for _, w := range writes {
		res := anon.do(t, w.method, w.path, strings.NewReader("note=x"), nil)
		require.Equal(t, http.StatusUnauthorized, res.status, "%s %s", w.method, w.path)
	}
	got, err := b.store.Get(t.Context(), j.ID)
	require.NoError(t, err)
	require.Equal(t, idempotency.StatusDead, got.Status)
}

func TestSignIn(t *testing.T) {
	b := setup(t, nil)
	u := b.anonymous()

	res := u.get(t, "/login?next=/dead")
	require.Equal(t, http.StatusOK, res.status)
	require.Contains(t, res.body, `name="next" value="/dead"`)

	res = u.post(t, "/login", url.Values{"name": {operatorName}, "password": {"wrong"}})
	require.Equal(t, http.StatusUnauthorized, res.status)
	require.Contains(t, res.body, "wrong name or password")
	res = u.post(t, "/login", url.Values{"name": {"nobody"}, "password": {operatorPassword}})
	require.Equal(t, http.StatusUnauthorized, res.status)
	require.Empty(t, res.header.Values("Set-Cookie"))

	// After sign-in the browser goes where it was going, never off-site.
	for next, want := range map[string]string{"/dead?kind=a": "/dead?kind=a", "//evil.example/x": "/",
		`/\evil.example`: "/", "https://evil.example/": "/", "": "/"} {
		res = u.post(t, "/login", url.Values{"name": {operatorName}, "password": {operatorPassword}, "next": {next}})
		require.Equal(t, http.StatusSeeOther, res.status)
		require.Equal(t, want, res.header.Get("Location"), next)
	}
	c := res.header.Get("Set-Cookie")
	require.Contains(t, c, "keel_session=")
	require.Contains(t, c, "HttpOnly")
	require.Contains(t, c, "SameSite=Strict")
	require.NotContains(t, c, "Secure", "plain HTTP on loopback: a Secure cookie would never come back")
	require.Equal(t, http.StatusOK, u.get(t, "/").status)

	// Signing out ends the session, even for a copy of the cookie.
	stolen := *u.c.Jar.Cookies(mustURL(t, b.ts.URL))[0]
	res = u.post(t, "/logout", url.Values{"csrf": {u.token(t)}})
	require.Equal(t, http.StatusSeeOther, res.status)
	require.Equal(t, http.StatusFound, u.get(t, "/").status)
	replayed := b.anonymous()
	replayed.c.Jar.SetCookies(mustURL(t, b.ts.URL), []*http.Cookie{&stolen})
	require.Equal(t, http.StatusFound, replayed.get(t, "/").status)
}

func TestSessionCookieCannotBeForged(t *testing.T) {
	b := setup(t, nil)
	viewer := b.signIn(t, viewerName, viewerPassword)
	c := viewer.c.Jar.Cookies(mustURL(t, b.ts.URL))[0]
	// A changed payload under the old signature: another user, a later expiry.
	payload, sig, _ := strings.Cut(c.Value, ".")
	raw, err := base64.RawURLEncoding.DecodeString(payload)
	require.NoError(t, err)
	forged := func(old, new string) string {
		return base64.RawURLEncoding.EncodeToString([]byte(strings.Replace(string(raw), old, new, 1))) + "." + sig
	}
	require.Contains(t, string(raw), "|vic|")
	for _, v := range []string{forged("|vic|", "|olga|"), forged("|17", "|27"), "x" + c.Value[1:], c.Value + "x", "", "a.b"} {
		u := b.anonymous()
		u.c.Jar.SetCookies(mustURL(t, b.ts.URL), []*http.Cookie{{Name: c.Name, Value: v}})
		require.Equal(t, http.StatusFound, u.get(t, "/").status, v)
	}
}

func TestTooManyFailedSignInsAreRefused(t *testing.T) {
	b := setup(t, nil)
	freeze(b)
	u := b.anonymous()
	for range web.AccountFreeAttempts {
		require.Equal(t, http.StatusUnauthorized, u.post(t, "/login", url.Values{"name": {operatorName}, "password": {"guess"}}).status)
	}
	res := u.post(t, "/login", url.Values{"name": {operatorName}, "password": {operatorPassword}})
	require.Equal(t, http.StatusTooManyRequests, res.status)
}

func TestViewerCannotChangeAnything(t *testing.T) {
	b := setup(t, nil)
	j := b.deadJob(t, "order:send_receipt", "order:1", "boom")
	viewer := b.signIn(t, viewerName, viewerPassword)
	tok := viewer.token(t)

	page := viewer.get(t, "/jobs/"+j.ID)
	require.Equal(t, http.StatusOK, page.status)
	require.NotContains(t, page.body, `id="replay"`)
	require.NotContains(t, page.body, `id="discard"`)
	require.NotContains(t, viewer.get(t, "/dead").body, `id="bulk-replay"`)

	for _, path := range []string{"/jobs/" + j.ID + "/replay", "/jobs/" + j.ID + "/discard", "/jobs/" + j.ID + "/resolve", "/dead/bulk"} {
		res := viewer.post(t, path, url.Values{"csrf": {tok}, "note": {"x"}, "action": {"discard"}, "expect": {"1"}})
		require.Equal(t, http.StatusForbidden, res.status, path)
	}
	require.Equal(t, http.StatusForbidden, viewer.get(t, "/dead/confirm?action=replay").status)

	// asynqmon: reads work, writes are refused before they reach it.
	require.Equal(t, http.StatusOK, viewer.get(t, "/monitoring/api/queues").status)
	require.Equal(t, http.StatusOK, viewer.get(t, "/monitoring/").status)
	require.Equal(t, http.StatusForbidden, viewer.do(t, "POST", "/monitoring/api/queues/default:pause", nil, nil).status)
	require.Equal(t, http.StatusForbidden, viewer.do(t, "DELETE", "/monitoring/api/queues/default/pending_tasks/"+j.ID, nil, nil).status)
	require.Contains(t, viewer.get(t, "/monitoring/").body, `window.FLAG_READ_ONLY="true"`)

	got, err := b.store.Get(t.Context(), j.ID)
	require.NoError(t, err)
	require.Equal(t, idempotency.StatusDead, got.Status)
	require.Empty(t, b.audit(t, j.ID))
}

func TestOperatorActionsAreAudited(t *testing.T) {
	b := setup(t, nil)
	j1 := b.deadJob(t, "order:send_receipt", "order:1", "boom")
	j2 := b.deadJob(t, "order:send_receipt", "order:2", "boom")
	op := b.signIn(t, operatorName, operatorPassword)
	tok := op.token(t)

	res := op.post(t, "/jobs/"+j1.ID+"/replay", url.Values{"csrf": {tok}, "note": {"fixed the mailer"}})
	require.Equal(t, http.StatusSeeOther, res.status, res.body)
	require.Equal(t, "/jobs/"+j1.ID+"?done=replayed", res.header.Get("Location"))
	got, err := b.store.Get(t.Context(), j1.ID)
	require.NoError(t, err)
	require.Equal(t, idempotency.StatusPending, got.Status)
	a := b.audit(t, j1.ID)
	require.Len(t, a, 1)
	require.Equal(t, "replay", a[0].Action)
	require.Equal(t, operatorName, a[0].Actor)
	require.Equal(t, "fixed the mailer", a[0].Note)
	page := op.get(t, "/jobs/"+j1.ID+"?done=replayed")
	require.Contains(t, page.body, "Replayed: the job is pending again")
	require.Contains(t, page.body, "fixed the mailer")

	// A second replay is refused politely: the job is no longer dead.
	res = op.post(t, "/jobs/"+j1.ID+"/replay", url.Values{"csrf": {tok}})
	require.Equal(t, "/jobs/"+j1.ID+"?done=already-replayed", res.header.Get("Location"))

	// Discard needs a note.
	res = op.post(t, "/jobs/"+j2.ID+"/discard", url.Values{"csrf": {tok}, "note": {"  "}})
	require.Equal(t, http.StatusBadRequest, res.status)
	require.Contains(t, res.body, "needs a note")
	res = op.post(t, "/jobs/"+j2.ID+"/discard", url.Values{"csrf": {tok}, "note": {"customer cancelled"}})
	require.Equal(t, http.StatusSeeOther, res.status, res.body)
	got, err = b.store.Get(t.Context(), j2.ID)
	require.NoError(t, err)
	require.Equal(t, idempotency.StatusDiscarded, got.Status)
	require.Equal(t, operatorName, got.ResolvedBy)
	page = op.get(t, "/jobs/"+j2.ID)
	require.Contains(t, page.body, "customer cancelled")
	require.Contains(t, page.body, "<code>discard</code>")

	// Replaying a discarded job is refused with the reason.
	res = op.post(t, "/jobs/"+j2.ID+"/replay", url.Values{"csrf": {tok}})
	require.Equal(t, http.StatusConflict, res.status)
	require.Contains(t, res.body, "was discarded")
}

func TestResolveAStepInDoubt(t *testing.T) {
	b := setup(t, nil)
	j := b.deadJob(t, "order:send_receipt", "order:1", "in doubt: needs a person")
	_, err := b.pool.Exec(t.Context(), `INSERT INTO keel_steps (job_id, name, status) VALUES ($1, 'mail', 'started')`, j.ID)
	require.NoError(t, err)
	op := b.signIn(t, operatorName, operatorPassword)
	tok := op.token(t)

	page := op.get(t, "/jobs/"+j.ID)
	require.Contains(t, page.body, "A step is in doubt")
	require.Contains(t, page.body, `<code class="step-key">`+j.ID+`:mail</code>`, "the key to look up at the other system")
	require.Contains(t, page.body, `id="replay" disabled`)
	res := op.post(t, "/jobs/"+j.ID+"/replay", url.Values{"csrf": {tok}})
	require.Equal(t, http.StatusConflict, res.status)
	require.Contains(t, res.body, "steps in doubt")

	res = op.post(t, "/jobs/"+j.ID+"/resolve", url.Values{"csrf": {tok}, "step": {"mail"}, "happened": {"yes"}, "note": {"saw it in the mail log"}})
	require.Equal(t, http.StatusSeeOther, res.status, res.body)
	steps, err := b.store.Steps(t.Context(), j.ID)
	require.NoError(t, err)
	require.Equal(t, "done", steps[0].Status)
	a := b.audit(t, j.ID)
	require.Len(t, a, 1)
	require.Equal(t, "step-happened:mail", a[0].Action)
	res = op.post(t, "/jobs/"+j.ID+"/replay", url.Values{"csrf": {tok}})
	require.Equal(t, http.StatusSeeOther, res.status)
}

// A step whose call may still be in flight says so on its page, and "It
// did not happen" is refused until the call has returned.
func TestAStepCallInFlightCannotBeSaidNotToHaveHappened(t *testing.T) {
	b := setup(t, nil)
	j := b.deadJob(t, "order:send_receipt", "order:1", "timeout")
	_, err := b.pool.Exec(t.Context(), `INSERT INTO keel_steps (job_id, name, status, call_until, call_holder)
		VALUES ($1, 'mail', 'started', now() + interval '1 minute', 'w1')`, j.ID)
	require.NoError(t, err)
	op := b.signIn(t, operatorName, operatorPassword)
	page := op.get(t, "/jobs/"+j.ID)
	require.Contains(t, page.body, `class="warn small in-flight">its call may still be in flight`)
	res := op.post(t, "/jobs/"+j.ID+"/resolve", url.Values{"csrf": {op.token(t)}, "step": {"mail"}, "happened": {"no"}, "note": {"not in the log"}})
	require.Equal(t, http.StatusConflict, res.status, res.body)
	require.Contains(t, res.body, "may still be in flight")
	steps, err := b.store.Steps(t.Context(), j.ID)
	require.NoError(t, err)
	require.Equal(t, "started", steps[0].Status)
}

// A step in doubt whose handler can Verify it does not wait for a person:
// the page says a replay settles it, and the replay is allowed.
func TestAVerifiableStepInDoubtIsSettledByAReplay(t *testing.T) {
	b := setup(t, nil)
	j := b.deadJob(t, "order:send_receipt", "order:1", "in doubt; Verify settles it when the job runs again")
	_, err := b.pool.Exec(t.Context(), `INSERT INTO keel_steps (job_id, name, status, verifiable) VALUES ($1, 'mail', 'started', true)`, j.ID)
	require.NoError(t, err)
	op := b.signIn(t, operatorName, operatorPassword)
	require.Empty(t, listed(t, op, "/jobs?status=in-doubt"), "waiting on no person's word")
	page := op.get(t, "/jobs/"+j.ID)
	require.NotContains(t, page.body, "A step is in doubt")
	require.NotContains(t, page.body, `id="replay" disabled`)
	require.Contains(t, page.body, "Verify settles it when the job runs again")
	res := op.post(t, "/jobs/"+j.ID+"/replay", url.Values{"csrf": {op.token(t)}})
	require.Equal(t, http.StatusSeeOther, res.status, res.body)
	got, err := b.store.Get(t.Context(), j.ID)
	require.NoError(t, err)
	require.Equal(t, idempotency.StatusPending, got.Status)
}

// A job whose completing InTx committed before its handler failed shows
// why it cannot be replayed, and a replay posted anyway is refused.
func TestJobWithCommittedEffectsIsNotReplayable(t *testing.T) {
	b := setup(t, nil)
	j := b.deadJob(t, "order:send_receipt", "order:1", "keel: handler failed after its completing InTx committed")
	_, err := b.pool.Exec(t.Context(), `UPDATE keel_jobs SET effects_committed_at = now() WHERE id = $1`, j.ID)
	require.NoError(t, err)
	op := b.signIn(t, operatorName, operatorPassword)
	tok := op.token(t)

	page := op.get(t, "/jobs/"+j.ID)
	require.Contains(t, page.body, `id="effects-committed"`)
	require.Contains(t, page.body, `id="not-replayable"`)
	require.NotContains(t, page.body, "an operator can replay it", "who handles it next")
	require.Contains(t, page.body, "cannot be replayed")
	require.NotContains(t, page.body, `id="replay"`)
	res := op.post(t, "/jobs/"+j.ID+"/replay", url.Values{"csrf": {tok}})
	require.Equal(t, http.StatusConflict, res.status)
	require.Contains(t, res.body, "local effects are in")
	got, err := b.store.Get(t.Context(), j.ID)
	require.NoError(t, err)
	require.Equal(t, idempotency.StatusDead, got.Status)
}

func TestCrossSiteRequestsAreRefused(t *testing.T) {
	b := setup(t, nil)
	j := b.deadJob(t, "order:send_receipt", "order:1", "boom")
	op := b.signIn(t, operatorName, operatorPassword)
	tok := op.token(t)
	form := func(v url.Values) *strings.Reader { return strings.NewReader(v.Encode()) }
	replay := "/jobs/" + j.ID + "/replay"

	// keel's forms: the token is required, and so is the origin.
	require.Equal(t, http.StatusForbidden, op.post(t, replay, url.Values{}).status, "no token")
	require.Equal(t, http.StatusForbidden, op.post(t, replay, url.Values{"csrf": {tok + "x"}}).status, "wrong token")
	require.Equal(t, http.StatusForbidden, op.do(t, "POST", replay, form(url.Values{"csrf": {tok}}),
		map[string]string{"Origin": "https://evil.example"}).status, "foreign origin")
	require.Equal(t, http.StatusForbidden, op.do(t, "POST", replay, form(url.Values{"csrf": {tok}}),
		map[string]string{"Origin": ""}).status, "no origin, no referer")
	require.Equal(t, http.StatusForbidden, op.do(t, "POST", replay, form(url.Values{"csrf": {tok}}),
		map[string]string{"Origin": b.ts.URL, "Sec-Fetch-Site": "cross-site"}).status, "browser says cross-site")
	require.Equal(t, http.StatusForbidden, op.do(t, "POST", replay, form(url.Values{"csrf": {tok}}),
		map[string]string{"Origin": "null"}).status, "opaque origin")
	got, err := b.store.Get(t.Context(), j.ID)
	require.NoError(t, err)
	require.Equal(t, idempotency.StatusDead, got.Status)
	// A same-origin Referer stands in for a missing Origin.
	res := op.do(t, "POST", replay, form(url.Values{"csrf": {tok}}),
		map[string]string{"Origin": "", "Referer": b.ts.URL + "/jobs/" + j.ID})
	require.Equal(t, http.StatusSeeOther, res.status)

	// asynqmon's API cannot carry keel's token: the origin check guards it.
	other := b.deadJob(t, "order:send_receipt", "order:2", "boom")
	del := "/monitoring/api/queues/default/pending_tasks/" + other.ID
	require.Equal(t, http.StatusForbidden, op.do(t, "DELETE", del, nil, map[string]string{"Origin": "https://evil.example"}).status)
	require.Equal(t, http.StatusForbidden, op.do(t, "DELETE", del, nil, map[string]string{"Origin": "", "Referer": "https://evil.example/x"}).status)
	require.Equal(t, http.StatusForbidden, op.do(t, "DELETE", del, nil, map[string]string{"Origin": ""}).status)
	res = op.do(t, "DELETE", del, nil, map[string]string{"Sec-Fetch-Site": "same-origin"})
	require.Equal(t, http.StatusNoContent, res.status, res.body)

	// Signing in from another site is refused too (login CSRF).
	res = b.anonymous().do(t, "POST", "/login", form(url.Values{"name": {operatorName}, "password": {operatorPassword}}),
		map[string]string{"Origin": "https://evil.example"})
	require.Equal(t, http.StatusForbidden, res.status)
}

func TestConfiguredOriginIsTheOnlyOneAccepted(t *testing.T) {
	b := setup(t, func(c *web.Config) { c.Origin = "https://jobs.example.com" })
	// Sign-in itself is a state change: from the server's own address it is
	// now cross-origin.
	res := b.anonymous().post(t, "/login", url.Values{"name": {operatorName}, "password": {operatorPassword}})
	require.Equal(t, http.StatusForbidden, res.status)
	u := b.anonymous()
	u.origin = "https://jobs.example.com"
	res = u.post(t, "/login", url.Values{"name": {operatorName}, "password": {operatorPassword}})
	require.Equal(t, http.StatusSeeOther, res.status)
}

func TestSecureCookiesBehindHTTPS(t *testing.T) {
	b := setup(t, func(c *web.Config) { c.BehindHTTPS = true })
	u := b.anonymous()
	u.origin = "https://" + strings.TrimPrefix(b.ts.URL, "http://")
	res := u.post(t, "/login", url.Values{"name": {viewerName}, "password": {viewerPassword}})
	require.Equal(t, http.StatusSeeOther, res.status)
	c := res.header.Get("Set-Cookie")
	require.True(t, strings.HasPrefix(c, "__Host-keel_session="), c)
	require.Contains(t, c, "Secure")
	require.Contains(t, c, "SameSite=Strict")
}

func TestSecurityHeaders(t *testing.T) {
	b := setup(t, nil)
	op := b.signIn(t, operatorName, operatorPassword)
	for _, p := range []string{"/", "/login", "/monitoring/", "/healthz"} {
		res := op.get(t, p)
		require.Equal(t, "nosniff", res.header.Get("X-Content-Type-Options"), p)
		require.Equal(t, "DENY", res.header.Get("X-Frame-Options"), p)
		require.Equal(t, "same-origin", res.header.Get("Referrer-Policy"), p)
		require.Contains(t, res.header.Get("Content-Security-Policy"), "frame-ancestors 'none'", p)
	}
	csp := op.get(t, "/").header.Get("Content-Security-Policy")
	require.Contains(t, csp, "default-src 'none'")
	require.NotContains(t, csp, "script-src", "keel's pages run no script")
	require.NotContains(t, csp, "unsafe-inline")
	require.Equal(t, "no-store", op.get(t, "/").header.Get("Cache-Control"))

	mon := op.get(t, "/monitoring/")
	csp = mon.header.Get("Content-Security-Policy")
	require.Regexp(t, `script-src 'self' 'sha256-[^']+' 'sha256-[^']+';`, csp)
	require.NotContains(t, csp, "'unsafe-eval'")
	require.Contains(t, mon.body, `window.FLAG_READ_ONLY="false"`, "operators get the writable asynqmon")
}

func TestEverythingAJobCarriesIsEscaped(t *testing.T) {
	b := setup(t, nil)
	const evil = `<script>alert(1)</script>"><img src=x onerror=alert(2)>`
	j := b.deadJob(t, "order:send_receipt", "order:<b>1</b>", evil)
	_, err := b.pool.Exec(t.Context(), `UPDATE keel_jobs SET payload_summary = $2, trace_id = $2, payload = $3 WHERE id = $1`,
		j.ID, evil, []byte(`{"note":"`+strings.ReplaceAll(evil, `"`, `\"`)+`"}`))
	require.NoError(t, err)
	_, err = b.pool.Exec(t.Context(), `INSERT INTO keel_steps (job_id, name, status, result) VALUES ($1, $2, 'done', $3)`, j.ID, evil, []byte(evil))
	require.NoError(t, err)
	op := b.signIn(t, operatorName, operatorPassword)
	res := op.post(t, "/jobs/"+j.ID+"/discard", url.Values{"csrf": {op.token(t)}, "note": {evil}})
	require.Equal(t, http.StatusSeeOther, res.status)
	_, err = b.pool.Exec(t.Context(), `UPDATE keel_jobs SET status = 'dead' WHERE id = $1`, j.ID)
	require.NoError(t, err)

	for _, p := range []string{"/dead", "/jobs/" + j.ID, "/dead/confirm?action=replay", "/", "/jobs?kind=order:send_receipt&key=" + url.QueryEscape(evil)} {
		body := op.get(t, p).body
		require.NotContains(t, body, "<script>alert", p)
		require.NotContains(t, body, "<img src=x", p)
		require.NotContains(t, body, "<b>1</b>", p)
	}
	body := op.get(t, "/jobs/"+j.ID).body
	require.Contains(t, body, "&lt;script&gt;alert(1)&lt;/script&gt;")
	require.Contains(t, body, "order:&lt;b&gt;1&lt;/b&gt;")
}

func TestLookup(t *testing.T) {
	b := setup(t, nil)
	j := b.deadJob(t, "order:send_receipt", "order:123", "boom")
	v := b.signIn(t, viewerName, viewerPassword)

	res := v.get(t, "/jobs?kind=order:send_receipt&key=order:123")
	require.Equal(t, http.StatusSeeOther, res.status)
	require.Equal(t, "/jobs/"+j.ID, res.header.Get("Location"))
	res = v.get(t, "/jobs?id="+j.ID)
	require.Equal(t, "/jobs/"+j.ID, res.header.Get("Location"))
	res = v.get(t, "/jobs?id="+url.QueryEscape("{"+strings.ToUpper(j.ID)+"}"))
	require.Equal(t, "/jobs/"+j.ID, res.header.Get("Location"), "another spelling of the id")
	res = v.get(t, "/jobs?kind=order:send_receipt&key=order:999")
	require.Equal(t, http.StatusNotFound, res.status)
	require.Contains(t, res.body, "no job with kind")
	require.Equal(t, http.StatusNotFound, v.get(t, "/jobs/nope").status)

	page := v.get(t, "/jobs/"+j.ID)
	require.Contains(t, page.body, "Waiting for a person")
	require.Contains(t, page.body, "trace-order:123")
}

func TestBulkActionsConfirmTheCount(t *testing.T) {
	b := setup(t, nil)
	for _, k := range []string{"order:1", "order:2", "order:3"} {
		b.deadJob(t, "order:send_receipt", k, "boom")
	}
	b.deadJob(t, "analytics:sync", "day:1", "boom")
	op := b.signIn(t, operatorName, operatorPassword)
	tok := op.token(t)

	page := op.get(t, "/dead?kind=order:send_receipt")
	require.Contains(t, page.body, "3 dead jobs")
	// One of them a replay would refuse: the replay's confirm page says so.
	inDoubt, err := b.ops.List(t.Context(), inspect.Filter{Kind: "order:send_receipt"}, 1, 0)
	require.NoError(t, err)
	_, err = b.pool.Exec(t.Context(), `INSERT INTO keel_steps (job_id, name, status) VALUES ($1, 'mail', 'started')`, inDoubt[0].ID)
	require.NoError(t, err)
	replay := op.get(t, "/dead/confirm?action=replay&kind=order:send_receipt")
	require.Contains(t, replay.body, `<p class="warn" id="refused">1 of them cannot be replayed`)
	require.NotContains(t, op.get(t, "/dead/confirm?action=discard&kind=order:send_receipt").body, `id="refused"`, "a discard refuses none of them")
	_, err = b.pool.Exec(t.Context(), `DELETE FROM keel_steps WHERE job_id = $1`, inDoubt[0].ID)
	require.NoError(t, err)
	require.Contains(t, page.body, `href="/dead/confirm?action=discard&amp;kind=order%3Asend_receipt"`)
	res := op.get(t, "/dead/confirm?action=discard&kind=order:send_receipt")
	require.Equal(t, http.StatusOK, res.status)
	require.Contains(t, res.body, "Discard 3 dead jobs?")
	require.Contains(t, res.body, `name="expect" value="3"`)

	form := url.Values{"csrf": {tok}, "action": {"discard"}, "kind": {"order:send_receipt"}, "note": {"bad batch"}}
	form.Set("expect", "2")
	res = op.post(t, "/dead/bulk", form)
	require.Equal(t, http.StatusConflict, res.status)
	require.Contains(t, res.body, "changed since you looked")
	require.Contains(t, res.body, `name="expect" value="3"`)

	form.Set("expect", "3")
	form.Set("note", "")
	require.Equal(t, http.StatusBadRequest, op.post(t, "/dead/bulk", form).status)

	// The count alone is not the confirmation: one job replayed and
	// another dead since the page was shown keep it at 3, but they are
	// not the jobs the person saw.
	res = op.get(t, "/dead/confirm?action=discard&kind=order:send_receipt")
	m := regexp.MustCompile(`name="seen" value="([^"]+)"`).FindStringSubmatch(res.body)
	require.NotNil(t, m, "the confirm page says when it was shown")
	form.Set("seen", m[1])
	form.Set("note", "bad batch")
	one, err := b.ops.List(t.Context(), inspect.Filter{Kind: "order:send_receipt"}, 1, 0)
	require.NoError(t, err)
	_, err = b.ops.Replay(t.Context(), one[0].ID, "someone", "")
	require.NoError(t, err)
	b.deadJob(t, "order:send_receipt", "order:4", "boom")
	res = op.post(t, "/dead/bulk", form)
	require.Equal(t, http.StatusConflict, res.status, res.body)
	require.Contains(t, res.body, "changed since you looked")
	replayed, err := b.store.Get(t.Context(), one[0].ID)
	require.NoError(t, err)
	require.Equal(t, idempotency.StatusPending, replayed.Status)

	m = regexp.MustCompile(`name="seen" value="([^"]+)"`).FindStringSubmatch(res.body)
	require.NotNil(t, m)
	form.Set("seen", m[1])
	res = op.post(t, "/dead/bulk", form)
	require.Equal(t, http.StatusOK, res.status, res.body)
	require.Contains(t, res.body, "3 of 3 done")
	n, err := b.ops.Count(t.Context(), inspect.Filter{})
	require.NoError(t, err)
	require.Equal(t, 1, n, "the other kind is untouched")
}

func TestMetricsNeedAuthOrToken(t *testing.T) {
	b := setup(t, func(c *web.Config) { c.MetricsToken = "prom-token" })
	b.deadJob(t, "order:send_receipt", "order:1", "boom")
	anon := b.anonymous()
	require.Equal(t, http.StatusUnauthorized, anon.get(t, "/metrics").status)
	require.Equal(t, http.StatusUnauthorized, anon.do(t, "GET", "/metrics", nil, map[string]string{"Authorization": "Bearer wrong"}).status)
	res := anon.do(t, "GET", "/metrics", nil, map[string]string{"Authorization": "Bearer prom-token"})
	require.Equal(t, http.StatusOK, res.status)
	require.Contains(t, res.body, `keel_queue_size{queue="default",state="pending"} 1`)
	require.Contains(t, res.body, `keel_dead_letters{class="permanent",kind="order:send_receipt",queue="default"} 1`)
	require.Contains(t, res.body, `keel_collector_up{source="redis"} 1`)
	require.Contains(t, res.body, "go_goroutines")
	require.Equal(t, http.StatusOK, b.signIn(t, viewerName, viewerPassword).get(t, "/metrics").status)
}

func TestPublicMetrics(t *testing.T) {
	b := setup(t, func(c *web.Config) { c.MetricsPublic = true })
	require.Equal(t, http.StatusOK, b.anonymous().get(t, "/metrics").status)
	require.Equal(t, http.StatusFound, b.anonymous().get(t, "/").status, "only /metrics is public")
}

func TestProxyHeaderSignIn(t *testing.T) {
	b := setup(t, func(c *web.Config) {
		c.Users = nil
		c.ProxyUserHeader = "X-Forwarded-User"
		c.ProxyOperators = []string{"ana"}
	})
	j := b.deadJob(t, "order:send_receipt", "order:1", "boom")
	anon := b.anonymous()
	require.Equal(t, http.StatusFound, anon.get(t, "/").status)

	ana := map[string]string{"X-Forwarded-User": "ana"}
	res := anon.do(t, "GET", "/jobs/"+j.ID, nil, ana)
	require.Equal(t, http.StatusOK, res.status)
	require.Contains(t, res.body, `id="replay"`)
	require.NotContains(t, res.body, `id="logout"`, "the proxy signs people out, not keel")
	tok := csrfField.FindStringSubmatch(res.body)[1]
	res = anon.do(t, "POST", "/jobs/"+j.ID+"/replay", strings.NewReader(url.Values{"csrf": {tok}}.Encode()), ana)
	require.Equal(t, http.StatusSeeOther, res.status)
	require.Equal(t, "ana", b.audit(t, j.ID)[0].Actor)

	bob := map[string]string{"X-Forwarded-User": "bob"}
	res = anon.do(t, "GET", "/", nil, bob)
	require.Equal(t, http.StatusOK, res.status)
	require.Contains(t, res.body, ">viewer<")
	require.Equal(t, http.StatusForbidden, anon.do(t, "POST", "/monitoring/api/queues/default:pause", nil, bob).status)
}

func TestProxyHeaderIsIgnoredUnlessEnabled(t *testing.T) {
	b := setup(t, nil)
	res := b.anonymous().do(t, "GET", "/", nil, map[string]string{"X-Forwarded-User": operatorName})
	require.Equal(t, http.StatusFound, res.status)
}

func TestRefusesToListenOpenlyWithoutCredentials(t *testing.T) {
	b := setup(t, nil)
	for _, addr := range []string{"0.0.0.0:8080", ":8080", "[::]:8080", "10.0.0.5:8080", "keel.internal:8080"} {
		_, err := web.New(web.Config{Addr: addr, Redis: b.redis, Pool: b.pool})
		require.ErrorIs(t, err, web.ErrNoCredentials, addr)
		require.Contains(t, err.Error(), "KEEL_WEB_USERS")
	}
	for _, addr := range []string{"127.0.0.1:8080", "localhost:8080", "[::1]:8080"} {
		s, err := web.New(web.Config{Addr: addr, Redis: b.redis, Pool: b.pool})
		require.NoError(t, err, addr)
		s.Close()
	}
	s, err := web.New(web.Config{Addr: "0.0.0.0:8080", Redis: b.redis, Pool: b.pool, Users: testUsers()})
	require.NoError(t, err)
	s.Close()
	s, err = web.New(web.Config{Addr: "0.0.0.0:8080", Redis: b.redis, Pool: b.pool, ProxyUserHeader: "X-Forwarded-User"})
	require.NoError(t, err)
	s.Close()
}

func TestConfigValidation(t *testing.T) {
	b := setup(t, nil)
	base := web.Config{Redis: b.redis, Pool: b.pool, Users: testUsers()}
	for name, mod := range map[string]func(*web.Config){
		"short secret":         func(c *web.Config) { c.Secret = []byte("short") },
		"cert without key":     func(c *web.Config) { c.TLSCertFile = "cert.pem" },
		"proxy operators only": func(c *web.Config) { c.ProxyOperators = []string{"ana"} },
		"cookie as header":     func(c *web.Config) { c.ProxyUserHeader = "Cookie" },
		"bad origin":           func(c *web.Config) { c.Origin = "jobs.example.com" },
		"origin with path":     func(c *web.Config) { c.Origin = "https://jobs.example.com/keel" },
		"duplicate user":       func(c *web.Config) { c.Users = append(testUsers(), testUsers()[0]) },
		"bad role": func(c *web.Config) {
			c.Users = []web.User{{Name: "x", Role: "admin", PasswordHash: hashes()[viewerPassword]}}
		},
		"plain password": func(c *web.Config) {
			c.Users = []web.User{{Name: "x", Role: web.RoleViewer, PasswordHash: []byte("hunter2")}}
		},
		"no redis": func(c *web.Config) { c.Redis = nil },
	} {
		cfg := base
		mod(&cfg)
		_, err := web.New(cfg)
		require.Error(t, err, name)
	}
}

func TestParseUsers(t *testing.T) {
	t.Parallel()
	h := string(hashes()[viewerPassword])
	users, err := web.ParseUsers(" ana:operator:" + h + " , ben:viewer:" + h + ",")
	require.NoError(t, err)
	require.Equal(t, []web.User{
		{Name: "ana", Role: web.RoleOperator, PasswordHash: []byte(h)},
		{Name: "ben", Role: web.RoleViewer, PasswordHash: []byte(h)},
	}, users)
	users, err = web.ParseUsers("")
	require.NoError(t, err)
	require.Empty(t, users)
	for _, bad := range []string{"ana", "ana:operator", "ana:root:" + h, ":viewer:" + h, "ana:viewer:secret"} {
		_, err := web.ParseUsers(bad)
		require.Error(t, err, bad)
	}
}

// Not parallel: it sets the package's hash cost.
func TestHashPassword(t *testing.T) {
	// HashPassword hashes at PasswordCost unless a test says otherwise...
	require.Equal(t, web.PasswordCost, web.HashCost())
	// ...and at whatever cost it is set to: a hash and a compare at
	// PasswordCost take many seconds under the race detector. MinCost+1,
	// so that a HashPassword fixed at MinCost fails too.
	web.SetHashCost(t, bcrypt.MinCost+1)
	h, err := web.HashPassword([]byte("correct horse"))
	require.NoError(t, err)
	require.NoError(t, bcrypt.CompareHashAndPassword([]byte(h), []byte("correct horse")))
	cost, err := bcrypt.Cost([]byte(h))
	require.NoError(t, err)
	require.Equal(t, bcrypt.MinCost+1, cost)
	_, err = web.HashPassword(nil)
	require.Error(t, err)
	_, err = web.HashPassword([]byte("1234567"))
	require.ErrorContains(t, err, "at least 8", "a password a guesser tries early is refused")
	_, err = web.HashPassword([]byte(strings.Repeat("x", 73)))
	require.Error(t, err, "bcrypt would silently ignore the rest")
	_, err = web.ParseUsers("ana:viewer:" + h)
	require.NoError(t, err, "a fresh hash is accepted in KEEL_WEB_USERS")
}

func mustURL(t *testing.T, s string) *url.URL {
	t.Helper()
	u, err := url.Parse(s)
	require.NoError(t, err)
	return u
}

func TestDeadLetterFilterAndPages(t *testing.T) {
	b := setup(t, func(c *web.Config) { c.PageSize = 2 })
	for _, k := range []string{"order:1", "order:2", "order:3"} {
		b.deadJob(t, "order:send_receipt", k, "boom")
	}
	b.deadJob(t, "analytics:sync", "day:1", "boom")
	v := b.signIn(t, viewerName, viewerPassword)

	page := v.get(t, "/dead?kind=order:send_receipt")
	require.Contains(t, page.body, "3 dead jobs")
	require.Equal(t, 2, strings.Count(page.body, `<tr class="dead-row"`))
	require.Contains(t, page.body, `href="/dead?kind=order%3Asend_receipt&amp;page=2"`)
	page = v.get(t, "/dead?kind=order:send_receipt&page=2")
	require.Equal(t, 1, strings.Count(page.body, `<tr class="dead-row"`))
	require.Contains(t, page.body, "page 2 of 2")

	require.Contains(t, v.get(t, "/dead?class=transient").body, "0 dead jobs")
	future := time.Now().UTC().Add(time.Hour).Format("2006-01-02T15:04")
	require.Contains(t, v.get(t, "/dead?since="+future).body, "0 dead jobs")
	past := time.Now().UTC().Add(-time.Hour).Format("2006-01-02T15:04")
	require.Contains(t, v.get(t, "/dead?since="+past).body, "4 dead jobs")
	res := v.get(t, "/dead?since=yesterday")
	require.Equal(t, http.StatusBadRequest, res.status)
	require.Contains(t, res.body, "want a UTC time")
	res = v.get(t, "/dead?class=bogus")
	require.Equal(t, http.StatusBadRequest, res.status, "a class typo lists nothing, silently")
	require.Contains(t, res.body, "no such class")
}

// The dead letters list tells a step its handler's Verify settles on replay
// from one a person must settle, as the job's page and the in-doubt filter
// do: both read "in doubt" there before.
func TestDeadLettersTellAVerifiableStepFromOneForAPerson(t *testing.T) {
	b := setup(t, nil)
	j := b.deadJob(t, "order:send_receipt", "order:1", "in doubt; Verify settles it when the job runs again")
	_, err := b.pool.Exec(t.Context(), `INSERT INTO keel_steps (job_id, name, status, verifiable) VALUES ($1, 'mail', 'started', true), ($1, 'charge', 'started', false)`, j.ID)
	require.NoError(t, err)
	body := b.signIn(t, viewerName, viewerPassword).get(t, "/dead").body
	require.Regexp(t, `<bdi>mail</bdi>: [^<]*Verify settles it`, body)
	require.Regexp(t, `<bdi>charge</bdi>: in doubt</span>`, body)
}
