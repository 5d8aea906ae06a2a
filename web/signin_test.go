package web_test

import (
	"net/http"
	"net/url"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// hostileNexts are after-sign-in targets that a browser would follow off
// this server if they were sent as given or as http.Redirect cleans them
// (browsers read a backslash in a path as a slash).
var hostileNexts = []string{
	`/./\evil.example`, `/../\evil.example`, `/x/../\evil.example`, `/.//evil.example`, `/x/..//evil.example`,
	`/\/evil.example`, `/%5Cevil.example`, "/.\\\tevil.example", `//evil.example`, `/\evil.example`,
	`https://evil.example`, `/./\evil.example/x?y=1`, "/\x0b/evil.example",
}

// staysHere reports whether a Location a browser follows keeps it on this
// server: a path that is neither network-path nor backslash-led, once
// browsers' own reading (a backslash is a slash) is applied.
func staysHere(loc string) bool {
	asBrowser := strings.ReplaceAll(loc, `\`, "/")
	return strings.HasPrefix(asBrowser, "/") && !strings.HasPrefix(asBrowser, "//")
}

func TestNoOpenRedirectAfterSignIn(t *testing.T) {
	b := setup(t, nil)
	u := b.signIn(t, operatorName, operatorPassword)
	for _, next := range hostileNexts {
		// Already signed in: the sign-in page sends the browser on at once.
		res := u.get(t, "/login?next="+url.QueryEscape(next))
		require.Equal(t, http.StatusSeeOther, res.status, next)
		require.True(t, staysHere(res.header.Get("Location")), "next %q: Location %q", next, res.header.Get("Location"))
		// Signing in.
		res = b.anonymous().post(t, "/login", url.Values{"name": {operatorName}, "password": {operatorPassword}, "next": {next}})
		require.Equal(t, http.StatusSeeOther, res.status, next)
		require.True(t, staysHere(res.header.Get("Location")), "next %q: Location %q", next, res.header.Get("Location"))
	}
	// Ordinary targets survive, as http.Redirect would send them.
	for next, want := range map[string]string{"/dead?kind=a%20b": "/dead?kind=a%20b", "/jobs/x/": "/jobs/x/",
		"/monitoring/queues/reports.v2": "/monitoring/queues/reports.v2", "/a/./b/../c?x=/../\\": "/a/c?x=/../\\"} {
		res := u.get(t, "/login?next="+url.QueryEscape(next))
		require.Equal(t, want, res.header.Get("Location"), next)
	}
}

// sessionOf is u's session cookie, as a thief would copy it.
func sessionOf(t *testing.T, u *user) *http.Cookie {
	t.Helper()
	for _, c := range u.c.Jar.Cookies(mustURL(t, u.b.ts.URL)) {
		if strings.HasSuffix(c.Name, "keel_session") {
			return c
		}
	}
	t.Fatal("no session cookie")
	return nil
}

// with returns a browser that talks to b carrying only cookie c.
func (b *bundle) with(t *testing.T, c *http.Cookie) *user {
	t.Helper()
	u := b.anonymous()
	u.c.Jar.SetCookies(mustURL(t, b.ts.URL), []*http.Cookie{c})
	return u
}

func TestSignOutHoldsOnOtherReplicasAndAfterARestart(t *testing.T) {
	b := setup(t, nil)
	other := b.replica(t)
	u := b.signIn(t, operatorName, operatorPassword)
	stolen := sessionOf(t, u)
	require.Equal(t, http.StatusOK, other.with(t, stolen).get(t, "/").status, "the same secret: a session works on every replica")

	require.Equal(t, http.StatusSeeOther, u.post(t, "/logout", url.Values{"csrf": {u.token(t)}}).status)
	require.Equal(t, http.StatusFound, b.with(t, stolen).get(t, "/").status, "signed out here")
	require.Equal(t, http.StatusFound, other.with(t, stolen).get(t, "/").status, "signed out on the other replica")
	require.Equal(t, http.StatusUnauthorized, other.with(t, stolen).get(t, "/monitoring/api/queues").status)
	restarted := b.replica(t)
	b.srv.Close()
	require.Equal(t, http.StatusFound, restarted.with(t, stolen).get(t, "/").status, "signed out after a restart")

	// Another session of the same user is not affected.
	again := restarted.signIn(t, operatorName, operatorPassword)
	require.Equal(t, http.StatusOK, other.with(t, sessionOf(t, again)).get(t, "/").status)
}

func TestASessionTheLedgerCannotCheckIsNotAccepted(t *testing.T) {
	b := setup(t, nil)
	u := b.signIn(t, viewerName, viewerPassword)
	_, err := b.pool.Exec(t.Context(), `ALTER TABLE keel_web_sessions_ended RENAME TO keel_web_sessions_gone`)
	require.NoError(t, err)
	res := u.get(t, "/")
	require.Equal(t, http.StatusServiceUnavailable, res.status)
	require.Contains(t, res.body, "could not check your session")
	require.NotContains(t, res.body, "keel_web_sessions_ended", "the database's error stays in the log")
	_, err = b.pool.Exec(t.Context(), `ALTER TABLE keel_web_sessions_gone RENAME TO keel_web_sessions_ended`)
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, u.get(t, "/").status)
}
