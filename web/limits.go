package web

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"strings"
	"sync"
	"time"
)

// Sign-in guessing is limited per client address, per account and per
// device, each attempt counted before its password is compared (so
// concurrent guesses cannot all slip past the count), and an attempt
// refused for want of a compare slot still counts: no refusal is a free
// retry.
//
//   - Per client address: loginAttemptsAllowed attempts per
//     loginAttemptWindow, then a hard refusal until the window ends; an
//     IPv6 client is its /56 (a customer's site: one holds 256 /64s), and
//     each /48 gets loginSiteAttemptsAllowed. A successful sign-in clears
//     the address's count. Behind a proxy the address is read from
//     X-Forwarded-For, but only when the connection comes from
//     Config.TrustedProxies.
//   - Per account, for attempts from browsers and addresses the account is
//     not known at: accountFreeAttempts, then one attempt per spacing that
//     doubles from accountFirstSpacing to accountMaxSpacing, whoever sends
//     it, until accountQuiet passes without an attempt. Guessing from many
//     addresses gains nothing; the account is slowed, never locked.
//   - Known clients are exempt from the account's slowdown, which others
//     can use up: a browser that signed in as the account before carries a
//     signed device cookie and is counted on its own (loginAttemptsAllowed
//     per window), and an address the account signed in from within
//     recentAddrTTL is counted as an address only.
//
// At most Config.LoginConcurrency comparisons run at once, and clients not
// known for the account they name may hold only part of them
// (unknownSlots): a flood of sign-ins from nowhere known is refused with
// 503 while known clients still get a slot, waiting up to loginSlotWait for
// one.
const (
	loginAttemptsAllowed     = 10
	loginSiteAttemptsAllowed = 5 * loginAttemptsAllowed
	loginAttemptWindow       = 5 * time.Minute
	accountFreeAttempts      = 5
	accountFirstSpacing      = time.Second
	accountMaxSpacing        = time.Minute
	accountQuiet             = 15 * time.Minute
	// recentAddrTTL is how long an address a user signed in from exempts
	// new browsers there from the account's slowdown.
	recentAddrTTL = 30 * 24 * time.Hour
	// deviceTTL is how long a device cookie exempts a browser from the
	// account's slowdown.
	deviceTTL = 90 * 24 * time.Hour
	// loginSlotWait is how long a known client waits for a compare slot.
	loginSlotWait = 2 * time.Second
	// maxTracked bounds each limiter's memory: expired entries are dropped
	// when it is exceeded, then the oldest.
	maxTracked = 10000
)

type attempts struct {
	n     int
	start time.Time // the window's start
}

// limiter counts attempts per key in fixed windows, with a hard limit.
type limiter struct {
	mu   sync.Mutex
	seen map[string]*attempts
}

func newLimiter() *limiter { return &limiter{seen: map[string]*attempts{}} }

// admit counts an attempt for key if fewer than limit were counted in its
// window.
func (l *limiter) admit(key string, now time.Time, limit int) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	a := l.seen[key]
	if a == nil || now.Sub(a.start) >= loginAttemptWindow {
		if a == nil && len(l.seen) >= maxTracked {
			l.shrink(now)
		}
		a = &attempts{start: now}
		l.seen[key] = a
	}
	if a.n >= limit {
		return false
	}
	a.n++
	return true
}

// shrink drops expired windows, and the oldest one if none has expired.
func (l *limiter) shrink(now time.Time) {
	var oldest string
	for k, a := range l.seen {
		if now.Sub(a.start) >= loginAttemptWindow {
			delete(l.seen, k)
		} else if oldest == "" || a.start.Before(l.seen[oldest].start) {
			oldest = k
		}
	}
	if len(l.seen) >= maxTracked {
		delete(l.seen, oldest)
	}
}

func (l *limiter) clear(key string) {
	l.mu.Lock()
	delete(l.seen, key)
	l.mu.Unlock()
}

// slowdown spaces an account's attempts from unknown clients out: free up
// to accountFreeAttempts, then further apart each time.
type slowdown struct {
	mu   sync.Mutex
	seen map[string]*spaced // only accounts that exist: a bounded map
}

type spaced struct {
	n    int
	last time.Time
}

func newSlowdown() *slowdown { return &slowdown{seen: map[string]*spaced{}} }

// admit counts an attempt for account, or returns how long to wait.
func (s *slowdown) admit(account string, now time.Time) (bool, time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	a := s.seen[account]
	if a == nil || now.Sub(a.last) >= accountQuiet {
		a = &spaced{}
		s.seen[account] = a
	}
	if a.n >= accountFreeAttempts {
		spacing := accountMaxSpacing
		if shift := a.n - accountFreeAttempts; shift < 16 {
			spacing = min(accountFirstSpacing<<shift, accountMaxSpacing)
		}
		if wait := a.last.Add(spacing).Sub(now); wait > 0 {
			return false, wait
		}
	}
	a.n++
	a.last = now
	return true, 0
}

// forgive takes back the count of an attempt that succeeded.
func (s *slowdown) forgive(account string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if a := s.seen[account]; a != nil && a.n > 0 {
		a.n--
	}
}

// recentAddrs are the addresses each account signed in from lately.
type recentAddrs struct {
	mu   sync.Mutex
	seen map[string]time.Time // account NUL address key → until
}

func newRecentAddrs() *recentAddrs { return &recentAddrs{seen: map[string]time.Time{}} }

func (r *recentAddrs) add(account, addr string, now time.Time) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.seen) >= maxTracked {
		var oldest string
		for k, until := range r.seen {
			if now.After(until) {
				delete(r.seen, k)
			} else if oldest == "" || until.Before(r.seen[oldest]) {
				oldest = k
			}
		}
		if len(r.seen) >= maxTracked {
			delete(r.seen, oldest)
		}
	}
	r.seen[account+"\x00"+addr] = now.Add(recentAddrTTL)
}

func (r *recentAddrs) has(account, addr string, now time.Time) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	until, ok := r.seen[account+"\x00"+addr]
	return ok && now.Before(until)
}

// compareSlots caps concurrent password comparisons, keeping some for
// clients known for the account they sign in to.
type compareSlots struct {
	all     chan struct{}
	unknown chan struct{}
}

// newCompareSlots makes n slots; unknown clients may hold n - n/2 of them
// (all of them when n is 1).
func newCompareSlots(n int) *compareSlots {
	return &compareSlots{all: make(chan struct{}, n), unknown: make(chan struct{}, n-n/2)}
}

// take takes a slot: at once for an unknown client, or within
// loginSlotWait for a known one.
func (c *compareSlots) take(ctx context.Context, known bool) bool {
	if known {
		t := time.NewTimer(loginSlotWait)
		defer t.Stop()
		select {
		case c.all <- struct{}{}:
			return true
		case <-t.C:
		case <-ctx.Done():
		}
		return false
	}
	select {
	case c.unknown <- struct{}{}:
	default:
		return false
	}
	select {
	case c.all <- struct{}{}:
		return true
	default:
		<-c.unknown
		return false
	}
}

func (c *compareSlots) release(known bool) {
	<-c.all
	if !known {
		<-c.unknown
	}
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
// is never read otherwise: anyone can send it. It returns the address's
// key (see addrKey) and, for IPv6, its /48's.
func clientAddr(remoteAddr string, forwardedFor []string, proxies []netip.Prefix) (key, site string) {
	host, _, err := net.SplitHostPort(remoteAddr)
	if err != nil {
		host = remoteAddr
	}
	peer, ok := parseAddr(host)
	if !ok {
		return host, ""
	}
	if !trusted(proxies, peer) {
		return addrKey(peer), siteKey(peer)
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
	return addrKey(client), siteKey(client)
}

// addrKey counts an IPv6 client by its /56: providers give a customer a
// /56 (or a /48), so a single attacker has 256 /64s or more to choose from.
func addrKey(a netip.Addr) string {
	if a.Is6() {
		p, _ := a.Prefix(56)
		return p.String()
	}
	return a.String()
}

// siteKey is an IPv6 client's /48, counted with a larger limit; empty for
// IPv4.
func siteKey(a netip.Addr) string {
	if a.Is6() {
		p, _ := a.Prefix(48)
		return p.String()
	}
	return ""
}
