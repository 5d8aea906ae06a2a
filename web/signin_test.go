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
