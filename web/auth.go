package web

import (
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"encoding/hex"
	"net/http"
	"net/netip"
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
	sid  string    // session id; empty when the proxy vouched for the user
	exp  time.Time // when the session's cookie expires
	csrf string    // the token this user's forms carry
}

// Operator reports whether p may change jobs.
func (p *principal) Operator() bool { return p != nil && p.Role == RoleOperator }

type principalKey struct{}

func principalFrom(ctx context.Context) *principal {
	p, _ := ctx.Value(principalKey{}).(*principal)
	return p
}

// auth signs people in and recognises them again. Sessions are HMAC-signed
// cookies naming the user and a session id; the role is looked up on every
// request, so changing KEEL_WEB_USERS takes effect at the next restart, and
// a changed password ends the user's old sessions. A session signed out
// before its expiry is recorded in the ledger (keel_web_sessions_ended),
// which every replica reads.
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

	ended *endedSessions

	deviceKey     []byte
	deviceName    string
	proxies       []netip.Prefix
	byAddr        *limiter
	byDevice      *limiter
	byAccount     *slowdown
	recent        *recentAddrs
	slots         *compareSlots
	dummyOnce     sync.Once
	dummyHash     []byte
	beforeCompare func(name string) // tests count comparisons here
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
		ended:          newEndedSessions(cfg.Pool),
		deviceKey:      derive(secret, "keel web device"),
		deviceName:     "keel_device",
		byAddr:         newLimiter(),
		byDevice:       newLimiter(),
		byAccount:      newSlowdown(),
		recent:         newRecentAddrs(),
		slots:          newCompareSlots(cfg.LoginConcurrency),
	}
	a.proxies, _ = parseTrustedProxies(cfg.TrustedProxies) // Validate has checked them
	if a.secure {
		// The __Host- prefix makes the browser refuse the cookie unless it is
		// Secure, host-only and for path / — no subdomain can plant one.
		a.cookieName = "__Host-keel_session"
		a.deviceName = "__Host-keel_device"
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
	p, err := a.identifyErr(r)
	if err != nil {
		return nil
	}
	return p
}

// identifyErr is identify that also says when a session could not be
// checked against the ledger's list of ended sessions; the principal is
// then returned with the error, for the caller to decide (see
// requireSignIn).
func (a *auth) identifyErr(r *http.Request) (*principal, error) {
	if a.proxyHeader != "" {
		if name := strings.TrimSpace(r.Header.Get(a.proxyHeader)); name != "" {
			if validName(name) != nil {
				return nil, nil
			}
			role := RoleViewer
			if a.proxyOperators[name] {
				role = RoleOperator
			}
			return &principal{Name: name, Role: role, csrf: a.mac(a.csrfKey, "proxy", name)}, nil
		}
	}
	c, err := r.Cookie(a.cookieName)
	if err != nil {
		return nil, nil
	}
	name, sid, exp, ok := a.verify(c.Value)
	if !ok {
		return nil, nil
	}
	p := &principal{Name: name, Role: a.users[name].Role, sid: sid, exp: exp, csrf: a.mac(a.csrfKey, "session", sid)}
	ended, err := a.ended.has(r.Context(), sid)
	if err != nil {
		return p, err
	}
	if ended {
		return nil, nil
	}
	return p, nil
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

// verify checks a session cookie's signature, expiry and password
// generation; whether the session was ended is the ledger's to say.
func (a *auth) verify(value string) (name, sid string, exp time.Time, ok bool) {
	enc, sig, found := strings.Cut(value, ".")
	if !found {
		return "", "", exp, false
	}
	raw, err := base64.RawURLEncoding.DecodeString(enc)
	if err != nil {
		return "", "", exp, false
	}
	payload := string(raw)
	if subtle.ConstantTimeCompare([]byte(sig), []byte(a.mac(a.sessionKey, payload))) != 1 {
		return "", "", exp, false
	}
	f := strings.Split(payload, "|")
	if len(f) != 5 || f[0] != "v1" {
		return "", "", exp, false
	}
	unix, err := strconv.ParseInt(f[3], 10, 64)
	if err != nil || a.now().Unix() >= unix {
		return "", "", exp, false
	}
	u, known := a.users[f[1]]
	if !known || generation(u) != f[4] {
		return "", "", exp, false
	}
	return f[1], f[2], time.Unix(unix, 0), true
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

// issueDevice returns the cookie that marks this browser as one name has
// signed in from.
func (a *auth) issueDevice(name string) *http.Cookie {
	var b [16]byte
	_, _ = rand.Read(b[:])
	exp := a.now().Add(deviceTTL)
	payload := strings.Join([]string{"d1", name, base64.RawURLEncoding.EncodeToString(b[:]), strconv.FormatInt(exp.Unix(), 10)}, "|")
	value := base64.RawURLEncoding.EncodeToString([]byte(payload)) + "." + a.mac(a.deviceKey, payload)
	return &http.Cookie{Name: a.deviceName, Value: value, Path: "/", HttpOnly: true, Secure: a.secure,
		SameSite: http.SameSiteStrictMode, Expires: exp, MaxAge: int(deviceTTL.Seconds())}
}

// device returns the id of r's device cookie when it was issued to name.
func (a *auth) device(r *http.Request, name string) (string, bool) {
	c, err := r.Cookie(a.deviceName)
	if err != nil {
		return "", false
	}
	enc, sig, found := strings.Cut(c.Value, ".")
	if !found {
		return "", false
	}
	raw, err := base64.RawURLEncoding.DecodeString(enc)
	if err != nil {
		return "", false
	}
	payload := string(raw)
	if subtle.ConstantTimeCompare([]byte(sig), []byte(a.mac(a.deviceKey, payload))) != 1 {
		return "", false
	}
	f := strings.Split(payload, "|")
	if len(f) != 4 || f[0] != "d1" || f[1] != name {
		return "", false
	}
	exp, err := strconv.ParseInt(f[3], 10, 64)
	if err != nil || a.now().Unix() >= exp {
		return "", false
	}
	return f[2], true
}

// attempt is one admitted sign-in attempt: what it was counted against.
type attempt struct {
	addr, site string // the client's address key, and its IPv6 /48
	device     string // the device cookie's id, for a browser known for the account
	known      bool   // a known device, or an address the account signed in from lately
}

// admitAttempt counts a sign-in attempt before any password is compared
// (see the limits in limits.go). It returns the HTTP status and the wait
// to report when the attempt is refused; an attempt refused for want of a
// compare slot stays counted.
func (a *auth) admitAttempt(r *http.Request, name string) (attempt, int, time.Duration) {
	now := a.now()
	var at attempt
	at.addr, at.site = clientAddr(r.RemoteAddr, r.Header.Values("X-Forwarded-For"), a.proxies)
	if id, ok := a.device(r, name); ok {
		// A browser the user signed in from: its own count, not the
		// address's or the account's, which others can use up.
		at.device, at.known = id, true
		if !a.byDevice.admit(id, now, loginAttemptsAllowed) {
			return at, http.StatusTooManyRequests, loginAttemptWindow
		}
	} else {
		if !a.byAddr.admit(at.addr, now, loginAttemptsAllowed) ||
			(at.site != "" && !a.byAddr.admit(at.site, now, loginSiteAttemptsAllowed)) {
			return at, http.StatusTooManyRequests, loginAttemptWindow
		}
		at.known = a.recent.has(name, at.addr, now)
		if _, exists := a.users[name]; exists && !at.known {
			if ok, wait := a.byAccount.admit(name, now); !ok {
				return at, http.StatusTooManyRequests, wait
			}
		}
	}
	if !a.slots.take(r.Context(), at.known) {
		return at, http.StatusServiceUnavailable, time.Second
	}
	return at, 0, 0
}

// tryPassword compares the password of an admitted attempt and settles
// its counts: a success clears the address's and the device's, does not
// count against the account, and makes the address a known one.
func (a *auth) tryPassword(at attempt, name, password string) (User, bool) {
	defer a.slots.release(at.known)
	if a.beforeCompare != nil {
		a.beforeCompare(name)
	}
	u, ok := a.checkPassword(name, password)
	if ok {
		if at.device != "" {
			a.byDevice.clear(at.device)
		} else {
			a.byAddr.clear(at.addr)
			if !at.known {
				a.byAccount.forgive(name)
			}
		}
		a.recent.add(name, at.addr, a.now())
	}
	return u, ok
}

// CSRF is the token this user's forms carry.
func (p *principal) CSRF() string { return p.csrf }

// SignedIn reports whether p has a session of keel's own to sign out of
// (users let in by a proxy sign out there).
func (p *principal) SignedIn() bool { return p.sid != "" }
