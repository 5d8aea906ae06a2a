package web_test

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"net/url"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/inspect"
	"github.com/keeljobs/keel/internal/testenv"
	"github.com/keeljobs/keel/web"
)

// frozenClock is a clock the test moves by hand.
type frozenClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *frozenClock) now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *frozenClock) add(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

func freeze(b *bundle) *frozenClock {
	c := &frozenClock{t: time.Now()}
	web.SetClock(b.srv, c.now)
	return c
}

// countCompares counts the password comparisons the server makes.
func countCompares(b *bundle) *atomic.Int64 {
	var n atomic.Int64
	web.SetCompareHook(b.srv, func(string) { n.Add(1) })
	return &n
}

func (u *user) signInFrom(t *testing.T, name, password, forwardedFor string) response {
	t.Helper()
	hdr := map[string]string{}
	if forwardedFor != "" {
		hdr["X-Forwarded-For"] = forwardedFor
	}
	return u.do(t, http.MethodPost, "/login", strings.NewReader(url.Values{"name": {name}, "password": {password}}.Encode()), hdr)
}

func TestParallelWrongPasswordsAreCountedBeforeTheCompare(t *testing.T) {
	// Enough compare slots for all: the count alone must hold the line.
	b := setup(t, func(c *web.Config) { c.LoginConcurrency = 60 })
	freeze(b)
	compares := countCompares(b)
	var wg sync.WaitGroup
	statuses := make([]int, 60)
	for i := range statuses {
		wg.Go(func() {
			statuses[i] = b.anonymous().signInFrom(t, operatorName, "guess", "").status
		})
	}
	wg.Wait()
	require.EqualValues(t, web.AccountFreeAttempts, compares.Load(), "only the account's free guesses reach bcrypt")
	n := map[int]int{}
	for _, s := range statuses {
		n[s]++
	}
	require.Equal(t, map[int]int{http.StatusUnauthorized: web.AccountFreeAttempts, http.StatusTooManyRequests: 60 - web.AccountFreeAttempts}, n)
}

func TestConcurrentComparesAreCapped(t *testing.T) {
	b := setup(t, func(c *web.Config) { c.LoginConcurrency = 2 })
	// The viewer signed in here before: this address is known for her.
	b.signIn(t, viewerName, viewerPassword)
	entered, release := make(chan string), make(chan struct{})
	var once sync.Once
	free := func() { once.Do(func() { close(release) }) }
	var wg sync.WaitGroup
	t.Cleanup(wg.Wait)
	t.Cleanup(free) // first, should the test fail with compares still held
	web.SetCompareHook(b.srv, func(name string) {
		if name == operatorName {
			entered <- name
			<-release
		}
	})
	// A sign-in from a browser and address nobody knows for the account
	// takes the one slot such sign-ins may hold...
	wg.Go(func() { b.anonymous().signInFrom(t, operatorName, "guess", "") })
	<-entered
	// ...so another is turned away at once, without waiting for bcrypt.
	res := b.anonymous().signInFrom(t, "nobody", "guess", "")
	require.Equal(t, http.StatusServiceUnavailable, res.status)
	require.NotEmpty(t, res.header.Get("Retry-After"))
	// The slot kept for known clients takes the viewer's compare.
	require.Equal(t, http.StatusSeeOther, b.anonymous().signInFrom(t, viewerName, viewerPassword, "").status)
	free()
}

func TestForwardedForIsReadOnlyFromTrustedProxies(t *testing.T) {
	b := setup(t, nil)
	freeze(b)
	// Not configured: X-Forwarded-For is anyone's to forge, so a new value
	// per guess does not buy new guesses.
	for i := range 10 {
		res := b.anonymous().signInFrom(t, fmt.Sprintf("nobody-%d", i), "guess", "198.51.100."+string(rune('0'+i)))
		require.Equal(t, http.StatusUnauthorized, res.status)
	}
	require.Equal(t, http.StatusTooManyRequests, b.anonymous().signInFrom(t, viewerName, "guess", "198.51.100.99").status)
}

func TestBehindAProxyOneAddressDoesNotLockOutEveryone(t *testing.T) {
	b := setup(t, func(c *web.Config) { c.TrustedProxies = []string{"127.0.0.0/8", "::1"} })
	freeze(b)
	const attacker = "203.0.113.7"
	for i := range 10 {
		require.Equal(t, http.StatusUnauthorized, b.anonymous().signInFrom(t, fmt.Sprintf("nobody-%d", i), "guess", attacker).status)
	}
	require.Equal(t, http.StatusTooManyRequests, b.anonymous().signInFrom(t, viewerName, "guess", attacker).status,
		"the attacker's address is blocked")
	// A forged hop in front of the proxy's own entry does not help: the
	// proxy appends the real address last.
	require.Equal(t, http.StatusTooManyRequests, b.anonymous().signInFrom(t, viewerName, "guess", "192.0.2.1, "+attacker).status)
	// Another user behind the same proxy signs in.
	require.Equal(t, http.StatusSeeOther, b.anonymous().signInFrom(t, viewerName, viewerPassword, "203.0.113.8").status)
}

func TestABrowserThatSignedInBeforeIsNotLockedOut(t *testing.T) {
	b := setup(t, nil)
	freeze(b)
	// The viewer signed in from this browser before (no proxy configured:
	// everyone shares one address).
	vic := b.signIn(t, viewerName, viewerPassword)
	require.Equal(t, http.StatusSeeOther, vic.post(t, "/logout", url.Values{"csrf": {vic.token(t)}}).status)
	for range 10 {
		require.Equal(t, http.StatusUnauthorized, b.anonymous().signInFrom(t, viewerName, "guess", "").status)
	}
	require.Equal(t, http.StatusTooManyRequests, b.anonymous().signInFrom(t, viewerName, viewerPassword, "").status,
		"a browser that never signed in is refused")
	require.Equal(t, http.StatusSeeOther, vic.signInFrom(t, viewerName, viewerPassword, "").status,
		"the user's own browser signs in")
	// Its device cookie is for that user only.
	require.Equal(t, http.StatusTooManyRequests, vic.signInFrom(t, operatorName, operatorPassword, "").status)
}

func TestUnknownHostsAreRefused(t *testing.T) {
	b := setup(t, nil)
	evil := strings.Replace(b.ts.URL, "127.0.0.1", "evil.example", 1)
	form := func() *strings.Reader {
		return strings.NewReader(url.Values{"name": {operatorName}, "password": {operatorPassword}}.Encode())
	}
	// A DNS-rebinding page: its own name, its own (matching) origin.
	u := b.anonymous()
	req, err := http.NewRequest(http.MethodPost, b.ts.URL+"/login", form())
	require.NoError(t, err)
	req.Host = strings.TrimPrefix(evil, "http://")
	req.Header.Set("Origin", evil)
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	res, err := u.c.Do(req)
	require.NoError(t, err)
	res.Body.Close()
	require.Equal(t, http.StatusMisdirectedRequest, res.StatusCode)
	require.Empty(t, res.Header.Values("Set-Cookie"))

	op := b.signIn(t, operatorName, operatorPassword)
	// The client sends no jar cookies to a Host other than the URL's; send
	// the session by hand, as a browser would to a name it was set for.
	session := op.c.Jar.Cookies(mustURL(t, b.ts.URL))
	withSession := func(req *http.Request) {
		for _, c := range session {
			req.AddCookie(c)
		}
	}
	for _, host := range []string{"evil.example", "EVIL.example:80", "127.0.0.1.evil.example"} {
		req, err := http.NewRequest(http.MethodPost, b.ts.URL+"/monitoring/api/queues/default:pause", nil)
		require.NoError(t, err)
		req.Host = host
		req.Header.Set("Origin", "http://"+host)
		withSession(req)
		res, err := op.c.Do(req)
		require.NoError(t, err)
		res.Body.Close()
		require.Equal(t, http.StatusMisdirectedRequest, res.StatusCode, host)
	}
	port := b.ts.URL[strings.LastIndex(b.ts.URL, ":"):]
	for _, host := range []string{"localhost" + port, "127.0.0.1" + port, "[::1]" + port, "LOCALHOST."} {
		req, err := http.NewRequest(http.MethodGet, b.ts.URL+"/", nil)
		require.NoError(t, err)
		req.Host = host
		withSession(req)
		res, err := op.c.Do(req)
		require.NoError(t, err)
		res.Body.Close()
		require.Equal(t, http.StatusOK, res.StatusCode, host)
	}
	// Probes and scrapers may use any name.
	req, err = http.NewRequest(http.MethodGet, b.ts.URL+"/healthz", nil)
	require.NoError(t, err)
	req.Host = "keel-web.svc"
	res, err = b.ts.Client().Do(req)
	require.NoError(t, err)
	res.Body.Close()
	require.Equal(t, http.StatusOK, res.StatusCode)
}

func TestConfiguredNamesAreAnswered(t *testing.T) {
	b := setup(t, func(c *web.Config) {
		c.Origin = "https://jobs.example.com"
		c.AllowedHosts = []string{"keel.internal"}
	})
	for host, want := range map[string]int{"jobs.example.com": http.StatusFound, "keel.internal:8080": http.StatusFound,
		"other.example": http.StatusMisdirectedRequest} {
		req, err := http.NewRequest(http.MethodGet, b.ts.URL+"/", nil)
		require.NoError(t, err)
		req.Host = host
		res, err := b.anonymous().c.Do(req)
		require.NoError(t, err)
		res.Body.Close()
		require.Equal(t, want, res.StatusCode, host)
	}
	_, err := web.New(web.Config{Redis: b.redis, Pool: b.pool, AllowedHosts: []string{"https://x.example"}})
	require.Error(t, err)
	_, err = web.New(web.Config{Redis: b.redis, Pool: b.pool, TrustedProxies: []string{"10.0.0.0/33"}})
	require.Error(t, err)
}

func TestNULAndInvalidUTF8Are400(t *testing.T) {
	b := setup(t, nil)
	j := b.deadJob(t, "order:send_receipt", "order:1", "boom")
	op := b.signIn(t, operatorName, operatorPassword)
	for _, p := range []string{"/dead?kind=%00", "/dead?queue=%ff", "/jobs/%00", "/jobs/%c3", "/jobs?kind=%00&key=x",
		"/jobs?id=a%00", "/jobs?batch=%00", "/jobs?batch=%ff", "/dead/confirm?action=replay&class=%00"} {
		res := op.get(t, p)
		require.Equal(t, http.StatusBadRequest, res.status, p)
		require.NotContains(t, res.body, "SQLSTATE", p)
	}
	res := op.post(t, "/jobs/"+j.ID+"/discard", url.Values{"csrf": {op.token(t)}, "note": {"why\x00"}})
	require.Equal(t, http.StatusBadRequest, res.status)
	res = b.anonymous().post(t, "/login", url.Values{"name": {"a\xff"}, "password": {"x"}})
	require.Equal(t, http.StatusBadRequest, res.status)
}

func TestBidiControlsInJobTextAreShown(t *testing.T) {
	b := setup(t, nil)
	const rlo = "\u202e"
	j := b.deadJob(t, "order:send_receipt", "order:"+rlo+"gnp.exe", "failed "+rlo+"txet desrever")
	v := b.signIn(t, viewerName, viewerPassword)
	for _, p := range []string{"/dead", "/jobs/" + j.ID, "/"} {
		body := v.get(t, p).body
		require.NotContains(t, body, rlo, p)
	}
	body := v.get(t, "/jobs/"+j.ID).body
	require.Contains(t, body, "order:[U&#43;202E]gnp.exe")
	require.Contains(t, body, "failed [U&#43;202E]txet desrever")
}

func TestNotesAreLimitedOnTheServer(t *testing.T) {
	b := setup(t, nil)
	j := b.deadJob(t, "order:send_receipt", "order:1", "boom")
	b.deadJob(t, "order:send_receipt", "order:2", "boom")
	op := b.signIn(t, operatorName, operatorPassword)
	tok := op.token(t)
	long := strings.Repeat("é", web.MaxNoteChars+1)
	for _, path := range []string{"/jobs/" + j.ID + "/discard", "/jobs/" + j.ID + "/replay", "/jobs/" + j.ID + "/resolve"} {
		res := op.post(t, path, url.Values{"csrf": {tok}, "note": {long}, "happened": {"yes"}, "step": {"x"}})
		require.Equal(t, http.StatusBadRequest, res.status, path)
	}
	res := op.post(t, "/dead/bulk", url.Values{"csrf": {tok}, "action": {"discard"}, "expect": {"2"}, "note": {strings.Repeat("x", 60000)}})
	require.Equal(t, http.StatusBadRequest, res.status)
	n, err := b.ops.Count(t.Context(), inspect.Filter{})
	require.NoError(t, err)
	require.Equal(t, 2, n)
	require.Empty(t, b.audit(t, j.ID))
	// Exactly the limit is fine.
	res = op.post(t, "/jobs/"+j.ID+"/discard", url.Values{"csrf": {tok}, "note": {long[:len(long)-2]}})
	require.Equal(t, http.StatusSeeOther, res.status)
}

func TestDiscardingTwiceSaysItWasAlreadyClosed(t *testing.T) {
	b := setup(t, nil)
	j := b.deadJob(t, "order:send_receipt", "order:1", "boom")
	op := b.signIn(t, operatorName, operatorPassword)
	tok := op.token(t)
	res := op.post(t, "/jobs/"+j.ID+"/discard", url.Values{"csrf": {tok}, "note": {"first"}})
	require.Equal(t, "/jobs/"+j.ID+"?done=discarded", res.header.Get("Location"))
	res = op.post(t, "/jobs/"+j.ID+"/discard", url.Values{"csrf": {tok}, "note": {"second"}})
	require.Equal(t, "/jobs/"+j.ID+"?done=already-discarded", res.header.Get("Location"))
	require.Contains(t, op.get(t, res.header.Get("Location")).body, "already closed")
	// A second discard without a note is told the same, not asked for a note.
	res = op.post(t, "/jobs/"+j.ID+"/discard", url.Values{"csrf": {tok}})
	require.Equal(t, "/jobs/"+j.ID+"?done=already-discarded", res.header.Get("Location"))
	require.Len(t, b.audit(t, j.ID), 1)
}

func TestSignInsAndAsynqmonWritesAreAudited(t *testing.T) {
	b := setup(t, nil)
	j := b.deadJob(t, "order:send_receipt", "order:1", "boom")
	require.Equal(t, http.StatusUnauthorized, b.anonymous().signInFrom(t, operatorName, "guess", "").status)
	op := b.signIn(t, operatorName, operatorPassword)
	res := op.do(t, http.MethodPost, "/monitoring/api/queues/default:pause", nil, nil)
	require.Equal(t, http.StatusNoContent, res.status, res.body)
	res = op.do(t, http.MethodDelete, "/monitoring/api/queues/default/pending_tasks/"+j.ID, nil, nil)
	require.Equal(t, http.StatusNoContent, res.status, res.body)

	rows, err := b.pool.Query(t.Context(), `SELECT job_id, action, actor, note FROM keel_audit ORDER BY id`)
	require.NoError(t, err)
	var got []string
	for rows.Next() {
		var id, action, actor, note string
		require.NoError(t, rows.Scan(&id, &action, &actor, &note))
		got = append(got, id+"|"+action+"|"+actor+"|"+note)
	}
	require.NoError(t, rows.Err())
	require.Equal(t, []string{
		"|sign-in-failed|" + operatorName + "|from 127.0.0.1",
		"|sign-in|" + operatorName + "|from 127.0.0.1",
		// The pause is keel's, recorded in the ledger with its own entry.
		"|pause-queue:default|" + operatorName + "|paused from asynqmon",
		"|asynqmon POST /queues/default:pause|" + operatorName + "|answered 204",
		j.ID + "|asynqmon DELETE /queues/default/pending_tasks/" + j.ID + "|" + operatorName + "|answered 204",
	}, got)
}

// A page the ledger cannot answer tells the viewer so, and gives the
// details — which name the database, its user and host — only to the
// server's log, under a reference the page shows.
func TestLedgerErrorsStayInTheLog(t *testing.T) {
	var logged testenv.SyncBuffer
	b := setup(t, func(c *web.Config) {
		pool, err := pgxpool.New(context.Background(), "postgres://secretuser@127.0.0.1:1/secretdb?sslmode=disable&connect_timeout=2")
		require.NoError(t, err)
		t.Cleanup(pool.Close)
		c.Pool = pool
		c.Logger = slog.New(slog.NewTextHandler(&logged, nil))
	})
	viewer := b.signIn(t, viewerName, viewerPassword)
	for _, path := range []string{"/", "/dead", "/jobs", "/batches", "/jobs/0190f1e2-0000-7000-8000-000000000000"} {
		res := viewer.get(t, path)
		if path == "/" {
			require.Equal(t, http.StatusOK, res.status, "the overview shows what it can")
		} else {
			require.Equal(t, http.StatusServiceUnavailable, res.status, path)
		}
		require.Contains(t, res.body, "could not be read", path)
		require.NotContains(t, res.body, "secretuser", path)
		require.NotContains(t, res.body, "secretdb", path)
		m := regexp.MustCompile(`ref ([0-9a-f]{8})`).FindStringSubmatch(res.body)
		require.NotNil(t, m, "%s: the page gives a reference to the log: %s", path, res.body)
		require.Regexp(t, `ref=`+m[1]+`.*secretuser`, logged.String(), path)
	}
}
