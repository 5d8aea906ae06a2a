package web_test

import (
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/web"
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

func TestASessionTheLedgerCannotCheckChangesNothing(t *testing.T) {
	b := setup(t, nil)
	j := b.deadJob(t, "order:send_receipt", "order:1", "boom")
	u := b.signIn(t, operatorName, operatorPassword)
	tok := u.token(t)
	_, err := b.pool.Exec(t.Context(), `ALTER TABLE keel_web_sessions_ended RENAME TO keel_web_sessions_gone`)
	require.NoError(t, err)
	// Reads go on (in a ledger outage the overview still shows Redis's side).
	require.Equal(t, http.StatusOK, u.get(t, "/").status)
	for _, path := range []string{"/jobs/" + j.ID + "/replay", "/monitoring/api/queues/default:pause"} {
		res := u.post(t, path, url.Values{"csrf": {tok}})
		require.Equal(t, http.StatusServiceUnavailable, res.status, path)
		require.Contains(t, res.body, "could not check your session", path)
		require.NotContains(t, res.body, "keel_web_sessions_ended", "the database's error stays in the log")
	}
	_, err = b.pool.Exec(t.Context(), `ALTER TABLE keel_web_sessions_gone RENAME TO keel_web_sessions_ended`)
	require.NoError(t, err)
	require.Equal(t, http.StatusSeeOther, u.post(t, "/jobs/"+j.ID+"/replay", url.Values{"csrf": {tok}}).status)
}

// behindProxy is a server behind a reverse proxy on this machine, whose
// X-Forwarded-For it reads.
func behindProxy(t *testing.T, mod func(*web.Config)) *bundle {
	return setup(t, func(c *web.Config) {
		c.TrustedProxies = []string{"127.0.0.0/8", "::1"}
		if mod != nil {
			mod(c)
		}
	})
}

// attacker sends wrong passwords, each from a new address.
type attacker struct{ n int }

func (a *attacker) guess(t *testing.T, b *bundle, name string) int {
	t.Helper()
	a.n++
	addr := fmt.Sprintf("198.51.%d.%d", 100+a.n/250, 1+a.n%250)
	return b.anonymous().signInFrom(t, name, fmt.Sprintf("guess-%d", a.n), addr).status
}

func TestAnAttackedAccountsOwnerStillSignsIn(t *testing.T) {
	b := behindProxy(t, nil)
	clock := freeze(b)
	const home = "203.0.113.50"
	// The owner signed in from home before, in a browser she has since
	// cleared (or in another one there).
	require.Equal(t, http.StatusSeeOther, b.anonymous().signInFrom(t, operatorName, operatorPassword, home).status)
	device := b.signIn(t, operatorName, operatorPassword) // and from this browser, elsewhere

	// An attacker guesses her password from ever-new addresses until the
	// account is slowed down.
	var a attacker
	for a.guess(t, b, operatorName) != http.StatusTooManyRequests {
		require.Less(t, a.n, 20, "the account was never slowed down")
	}
	// While the attack goes on, she signs in: from a new browser at home,
	// and from her own browser anywhere.
	for i := range 10 {
		clock.add(time.Second)
		a.guess(t, b, operatorName)
		require.Equal(t, http.StatusSeeOther, b.anonymous().signInFrom(t, operatorName, operatorPassword, home).status, "new browser at home, try %d", i)
		require.Equal(t, http.StatusSeeOther, device.signInFrom(t, operatorName, operatorPassword, fmt.Sprintf("192.0.2.%d", 10+i)).status,
			"her own browser, try %d", i)
	}
	// A new browser at an address she never signed in from is where the
	// attacker stands: it waits as the attacker does (see the README).
	res := b.anonymous().signInFrom(t, operatorName, operatorPassword, "192.0.2.200")
	require.Equal(t, http.StatusTooManyRequests, res.status)
	require.NotEmpty(t, res.header.Get("Retry-After"))
}

func TestGuessesPerAccountAreBounded(t *testing.T) {
	b := behindProxy(t, nil)
	clock := freeze(b)
	compares := countCompares(b)
	var a attacker
	// Two guesses a second, from a new address each, for 45 s.
	for range 90 {
		a.guess(t, b, viewerName)
		clock.add(500 * time.Millisecond)
	}
	require.LessOrEqual(t, compares.Load(), int64(10), "guesses that reached bcrypt in 45 s")
	// And for an hour.
	for range 720 {
		a.guess(t, b, viewerName)
		clock.add(5 * time.Second)
	}
	require.LessOrEqual(t, compares.Load(), int64(10+61), "guesses that reached bcrypt in the hour")
}

func TestAFloodOfSignInsLeavesRoomForKnownBrowsers(t *testing.T) {
	b := behindProxy(t, func(c *web.Config) { c.LoginConcurrency = 2 })
	freeze(b)
	device := b.signIn(t, viewerName, viewerPassword)
	require.Equal(t, http.StatusSeeOther, b.anonymous().signInFrom(t, operatorName, operatorPassword, "203.0.113.50").status)

	// Compares of the flood's names hang, as if bcrypt were saturated.
	entered, release := make(chan string, 100), make(chan struct{})
	var once sync.Once
	free := func() { once.Do(func() { close(release) }) }
	var wg sync.WaitGroup
	t.Cleanup(wg.Wait)
	t.Cleanup(free) // first, should the test fail with compares still held
	web.SetCompareHook(b.srv, func(name string) {
		if strings.HasPrefix(name, "flood-") {
			entered <- name
			<-release
		}
	})
	wg.Go(func() { b.anonymous().signInFrom(t, "flood-0", "x", "198.51.100.1") })
	<-entered
	// The flood holds every slot a browser nobody knows may use: more
	// sign-ins from nowhere known are turned away at once, with random
	// names from many addresses...
	for i := range 20 {
		res := b.anonymous().signInFrom(t, fmt.Sprintf("flood-%d", i+1), "x", fmt.Sprintf("198.51.101.%d", i+1))
		require.Equal(t, http.StatusServiceUnavailable, res.status)
		require.NotEmpty(t, res.header.Get("Retry-After"))
	}
	// ...and a refusal is no free retry: it used one of the address's
	// attempts.
	for i := range 10 {
		require.Equal(t, http.StatusServiceUnavailable, b.anonymous().signInFrom(t, fmt.Sprintf("flood-x%d", i), "x", "198.51.102.1").status)
	}
	require.Equal(t, http.StatusTooManyRequests, b.anonymous().signInFrom(t, "flood-x", "x", "198.51.102.1").status)

	// Browsers that signed in before, and new ones at an address their
	// user signed in from, still get in.
	require.Equal(t, http.StatusSeeOther, device.signInFrom(t, viewerName, viewerPassword, "198.51.103.1").status)
	require.Equal(t, http.StatusSeeOther, b.anonymous().signInFrom(t, operatorName, operatorPassword, "203.0.113.50").status)
	require.Empty(t, entered, "no compare of the flood's got in")
	free()
}

func TestIPv6ClientsAreCountedByTheirSite(t *testing.T) {
	b := behindProxy(t, nil)
	freeze(b)
	// Every /64 of one /56 is one client: a customer's site.
	for i := range 10 {
		require.Equal(t, http.StatusUnauthorized, b.anonymous().signInFrom(t, fmt.Sprintf("nobody-%d", i), "x",
			fmt.Sprintf("2001:db8:1:%x::1", 0x1100+i)).status)
	}
	require.Equal(t, http.StatusTooManyRequests, b.anonymous().signInFrom(t, "nobody", "x", "2001:db8:1:11ff::2").status)
	// Other /56s of the same /48 share a larger count.
	n := 0
	for site := 0x12; site < 0x40; site++ {
		for i := range 10 {
			status := b.anonymous().signInFrom(t, fmt.Sprintf("nobody-%d", i), "x", fmt.Sprintf("2001:db8:1:%x%02x::1", site, i)).status
			if status == http.StatusTooManyRequests {
				require.Equal(t, web.SitePrefixAttempts, n+10, "the /48's count")
				return
			}
			require.Equal(t, http.StatusUnauthorized, status)
			n++
		}
	}
	t.Fatal("the /48 was never refused")
}
