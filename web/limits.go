package web

import (
	"fmt"
	"net"
	"net/netip"
	"strings"
	"sync"
	"time"
)

// Sign-in guessing is limited three ways, each attempt counted before its
// password is compared (so concurrent guesses cannot all slip past the
// count):
//
//   - Per client address: loginAttemptsAllowed attempts per
//     loginAttemptWindow, then a hard refusal until the window ends. A
//     successful sign-in clears the address's count. Behind a proxy the
//     address is read from X-Forwarded-For, but only when the connection
//     comes from Config.TrustedProxies; otherwise everyone behind the proxy
//     would share one count, and ten bad guesses would lock all of them out.
//   - Per account: after loginAttemptsAllowed attempts in the window the
//     account is slowed down, not locked: one attempt per
//     loginAccountSpacing, whoever sends it. Guessing from many addresses
//     gains little, and the real user waits seconds, not the window.
//   - A browser that signed in as the account before carries a signed
//     device cookie; its attempts for that account are counted per device
//     instead, so an attacker hammering the account (or sharing the
//     user's address) does not lock that user out at all.
//
// At most Config.LoginConcurrency comparisons run at once; more get 503 at
// once rather than queueing behind bcrypt.
const (
	loginAttemptsAllowed = 10
	loginAttemptWindow   = 5 * time.Minute
	loginAccountSpacing  = 5 * time.Second
	// deviceTTL is how long a device cookie exempts a browser from the
	// account's slowdown.
	deviceTTL = 90 * 24 * time.Hour
	// maxTracked bounds each limiter's memory; expired entries are dropped
	// when it is exceeded.
	maxTracked = 10000
)

type attempts struct {
	n     int
	start time.Time // the window's start
	last  time.Time // the last admitted attempt
}

type limiter struct {
	mu   sync.Mutex
	seen map[string]*attempts
}

func newLimiter() *limiter { return &limiter{seen: map[string]*attempts{}} }

func (l *limiter) entry(key string, now time.Time) *attempts {
	if len(l.seen) > maxTracked {
		for k, a := range l.seen {
			if now.Sub(a.start) >= loginAttemptWindow {
				delete(l.seen, k)
			}
		}
	}
	a := l.seen[key]
	if a == nil || now.Sub(a.start) >= loginAttemptWindow {
		a = &attempts{start: now}
		l.seen[key] = a
	}
	return a
}

// admit counts an attempt for key if the hard limit allows it.
func (l *limiter) admit(key string, now time.Time) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	a := l.entry(key, now)
	if a.n >= loginAttemptsAllowed {
		return false
	}
	a.n++
	a.last = now
	return true
}

// admitSlowly counts an attempt for key: freely up to the limit, then one
// per spacing. It returns how long to wait when it refuses.
func (l *limiter) admitSlowly(key string, now time.Time, spacing time.Duration) (bool, time.Duration) {
	l.mu.Lock()
	defer l.mu.Unlock()
	a := l.entry(key, now)
	if a.n >= loginAttemptsAllowed {
		if wait := a.last.Add(spacing).Sub(now); wait > 0 {
			return false, wait
		}
	}
	a.n++
	a.last = now
	return true, 0
}

// refund takes back an attempt that was counted but not tried (or that
// succeeded).
func (l *limiter) refund(key string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if a := l.seen[key]; a != nil && a.n > 0 {
		a.n--
	}
}

func (l *limiter) clear(key string) {
	l.mu.Lock()
	delete(l.seen, key)
	l.mu.Unlock()
}

// parseTrustedProxies reads addresses and CIDR prefixes.
func parseTrustedProxies(list []string) ([]netip.Prefix, error) {
	var out []netip.Prefix
	for _, s := range list {
		s = strings.TrimSpace(s)
		if s == "" {
			continue
		}
		if p, err := netip.ParsePrefix(s); err == nil {
			out = append(out, p.Masked())
			continue
		}
		a, err := netip.ParseAddr(s)
		if err != nil {
			return nil, fmt.Errorf("keel web: trusted proxy %q: want an IP address or a CIDR prefix like 10.0.0.0/8", s)
		}
		a = a.Unmap()
		out = append(out, netip.PrefixFrom(a, a.BitLen()))
	}
	return out, nil
}

func trusted(proxies []netip.Prefix, a netip.Addr) bool {
	a = a.Unmap()
	for _, p := range proxies {
		if p.Contains(a) {
			return true
		}
	}
	return false
}

// parseAddr reads an address as X-Forwarded-For or RemoteAddr spell it:
// bare, or with a port.
func parseAddr(s string) (netip.Addr, bool) {
	s = strings.TrimSpace(s)
	if a, err := netip.ParseAddr(s); err == nil {
		return a.Unmap(), true
	}
	if ap, err := netip.ParseAddrPort(s); err == nil {
		return ap.Addr().Unmap(), true
	}
	return netip.Addr{}, false
}

// clientAddr is the address sign-in attempts are counted against: the
// connection's peer, or, when that peer is a trusted proxy, the nearest
// address in X-Forwarded-For that is not a trusted proxy. X-Forwarded-For
// is never read otherwise: anyone can send it.
func clientAddr(remoteAddr string, forwardedFor []string, proxies []netip.Prefix) string {
	host, _, err := net.SplitHostPort(remoteAddr)
	if err != nil {
		host = remoteAddr
	}
	peer, ok := parseAddr(host)
	if !ok {
		return host
	}
	if !trusted(proxies, peer) {
		return addrKey(peer)
	}
	var hops []string
	for _, v := range forwardedFor {
		hops = append(hops, strings.Split(v, ",")...)
	}
	client := peer
	for i := len(hops) - 1; i >= 0; i-- {
		a, ok := parseAddr(hops[i])
		if !ok {
			break // garbage: stop at the last address that was vouched for
		}
		client = a
		if !trusted(proxies, a) {
			break
		}
	}
	return addrKey(client)
}

// addrKey counts an IPv6 client by its /64, which one host usually owns
// whole.
func addrKey(a netip.Addr) string {
	if a.Is6() {
		p, _ := a.Prefix(64)
		return p.String()
	}
	return a.String()
}
