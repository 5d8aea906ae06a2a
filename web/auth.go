package web

import (
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"encoding/hex"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/crypto/bcrypt"
)

// principal is who a request comes from.
type principal struct {
	Name string
	Role Role
	sid  string // session id; empty when the proxy vouched for the user
	csrf string // the token this user's forms carry
}

// Operator reports whether p may change jobs.
func (p *principal) Operator() bool { return p != nil && p.Role == RoleOperator }

type principalKey struct{}

func principalFrom(ctx context.Context) *principal {
	p, _ := ctx.Value(principalKey{}).(*principal)
	return p
}

// auth signs people in and recognises them again. Sessions are stateless
// HMAC-signed cookies naming the user; the role is looked up on every
// request, so changing KEEL_WEB_USERS takes effect at the next restart, and
// a changed password ends the user's old sessions.
type auth struct {
	users          map[string]User
	sessionKey     []byte
	csrfKey        []byte
	ttl            time.Duration
	cookieName     string
	secure         bool
	proxyHeader    string
	proxyOperators map[string]bool
	now            func() time.Time

	mu      sync.Mutex
	revoked map[string]time.Time // session id → its expiry (logged out)

	failures  failureLimiter
	dummyOnce sync.Once
	dummyHash []byte
}

func newAuth(cfg Config, secret []byte) *auth {
	a := &auth{
		users:          map[string]User{},
		sessionKey:     derive(secret, "keel web session"),
		csrfKey:        derive(secret, "keel web csrf"),
		ttl:            cfg.SessionTTL,
		cookieName:     "keel_session",
		secure:         cfg.BehindHTTPS,
		proxyHeader:    cfg.ProxyUserHeader,
		proxyOperators: map[string]bool{},
		now:            time.Now,
		revoked:        map[string]time.Time{},
		failures:       failureLimiter{max: loginFailuresAllowed, window: loginFailureWindow, seen: map[string]*failureCount{}},
	}
	if a.secure {
		// The __Host- prefix makes the browser refuse the cookie unless it is
		// Secure, host-only and for path / — no subdomain can plant one.
		a.cookieName = "__Host-keel_session"
	}
	for _, u := range cfg.Users {
		a.users[u.Name] = u
	}
	for _, n := range cfg.ProxyOperators {
		if n = strings.TrimSpace(n); n != "" {
			a.proxyOperators[n] = true
		}
	}
	return a
}

func derive(secret []byte, purpose string) []byte {
	m := hmac.New(sha256.New, secret)
	m.Write([]byte(purpose))
	return m.Sum(nil)
}

func (a *auth) mac(key []byte, parts ...string) string {
	m := hmac.New(sha256.New, key)
	m.Write([]byte(strings.Join(parts, "|")))
	return base64.RawURLEncoding.EncodeToString(m.Sum(nil))
}

// generation changes whenever the user's password hash does.
func generation(u User) string {
	sum := sha256.Sum256(u.PasswordHash)
	return hex.EncodeToString(sum[:8])
}

// identify returns who sent r, or nil.
func (a *auth) identify(r *http.Request) *principal {
	if a.proxyHeader != "" {
		if name := strings.TrimSpace(r.Header.Get(a.proxyHeader)); name != "" {
			if validName(name) != nil {
				return nil
			}
			role := RoleViewer
			if a.proxyOperators[name] {
				role = RoleOperator
			}
			return &principal{Name: name, Role: role, csrf: a.mac(a.csrfKey, "proxy", name)}
		}
	}
	c, err := r.Cookie(a.cookieName)
	if err != nil {
		return nil
	}
	name, sid, ok := a.verify(c.Value)
	if !ok {
		return nil
	}
	return &principal{Name: name, Role: a.users[name].Role, sid: sid, csrf: a.mac(a.csrfKey, "session", sid)}
}

// issue returns a session cookie for u.
func (a *auth) issue(u User) *http.Cookie {
	var b [16]byte
	_, _ = rand.Read(b[:])
	sid := base64.RawURLEncoding.EncodeToString(b[:])
	exp := a.now().Add(a.ttl)
	payload := strings.Join([]string{"v1", u.Name, sid, strconv.FormatInt(exp.Unix(), 10), generation(u)}, "|")
	value := base64.RawURLEncoding.EncodeToString([]byte(payload)) + "." + a.mac(a.sessionKey, payload)
	return a.cookie(value, exp)
}

func (a *auth) cookie(value string, exp time.Time) *http.Cookie {
	c := &http.Cookie{Name: a.cookieName, Value: value, Path: "/", HttpOnly: true, Secure: a.secure,
		SameSite: http.SameSiteStrictMode}
	if exp.IsZero() {
		c.MaxAge = -1
	} else {
		c.Expires = exp
		c.MaxAge = int(time.Until(exp).Seconds())
	}
	return c
}

func (a *auth) verify(value string) (name, sid string, ok bool) {
	enc, sig, found := strings.Cut(value, ".")
	if !found {
		return "", "", false
	}
	raw, err := base64.RawURLEncoding.DecodeString(enc)
	if err != nil {
		return "", "", false
	}
	payload := string(raw)
	if subtle.ConstantTimeCompare([]byte(sig), []byte(a.mac(a.sessionKey, payload))) != 1 {
		return "", "", false
	}
	f := strings.Split(payload, "|")
	if len(f) != 5 || f[0] != "v1" {
		return "", "", false
	}
	exp, err := strconv.ParseInt(f[3], 10, 64)
	if err != nil || a.now().Unix() >= exp {
		return "", "", false
	}
	u, known := a.users[f[1]]
	if !known || generation(u) != f[4] {
		return "", "", false
	}
	a.mu.Lock()
	_, gone := a.revoked[f[2]]
	a.mu.Unlock()
	if gone {
		return "", "", false
	}
	return f[1], f[2], true
}

// revoke ends a session before its expiry (logout). The list lives in this
// process only; with several replicas a logged-out cookie still works on
// the others until it expires — the cookie itself is deleted either way.
func (a *auth) revoke(sid string) {
	if sid == "" {
		return
	}
	now := a.now()
	a.mu.Lock()
	defer a.mu.Unlock()
	for id, exp := range a.revoked {
		if now.After(exp) {
			delete(a.revoked, id)
		}
	}
	a.revoked[sid] = now.Add(a.ttl)
}

// checkPassword returns the user name and password identify. Unknown names
// cost as much time as wrong passwords, so timing does not tell which
// names exist.
func (a *auth) checkPassword(name, password string) (User, bool) {
	u, ok := a.users[name]
	if !ok || len(password) > MaxPasswordBytes {
		a.dummyOnce.Do(func() {
			cost := PasswordCost
			for _, u := range a.users {
				if c, err := bcrypt.Cost(u.PasswordHash); err == nil {
					cost = c
				}
				break
			}
			a.dummyHash, _ = bcrypt.GenerateFromPassword([]byte("keel: no such user"), cost)
		})
		_ = bcrypt.CompareHashAndPassword(a.dummyHash, []byte(password))
		return User{}, false
	}
	if bcrypt.CompareHashAndPassword(u.PasswordHash, []byte(password)) != nil {
		return User{}, false
	}
	return u, true
}

// Sign-in guessing is limited per client address.
const (
	loginFailuresAllowed = 10
	loginFailureWindow   = 5 * time.Minute
)

type failureCount struct {
	n     int
	until time.Time
}

type failureLimiter struct {
	max    int
	window time.Duration
	mu     sync.Mutex
	seen   map[string]*failureCount
}

func clientIP(r *http.Request) string {
	host, _, err := net.SplitHostPort(r.RemoteAddr)
	if err != nil {
		return r.RemoteAddr
	}
	return host
}

func (l *failureLimiter) blocked(ip string, now time.Time) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	f := l.seen[ip]
	return f != nil && now.Before(f.until) && f.n >= l.max
}

func (l *failureLimiter) fail(ip string, now time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.seen) > 10000 {
		for k, f := range l.seen {
			if now.After(f.until) {
				delete(l.seen, k)
			}
		}
	}
	f := l.seen[ip]
	if f == nil || now.After(f.until) {
		f = &failureCount{until: now.Add(l.window)}
		l.seen[ip] = f
	}
	f.n++
}

func (l *failureLimiter) reset(ip string) {
	l.mu.Lock()
	delete(l.seen, ip)
	l.mu.Unlock()
}

// CSRF is the token this user's forms carry.
func (p *principal) CSRF() string { return p.csrf }

// SignedIn reports whether p has a session of keel's own to sign out of
// (users let in by a proxy sign out there).
func (p *principal) SignedIn() bool { return p.sid != "" }
