package web

import (
	"net/http"
	"net/url"
	"path"
	"strconv"
	"strings"
	"time"
)

type loginData struct {
	Next          string
	Name          string
	PasswordLogin bool
	ProxyHeader   string
}

func (s *Server) loginData(next, name string) loginData {
	return loginData{Next: next, Name: name, PasswordLogin: len(s.cfg.Users) > 0, ProxyHeader: s.cfg.ProxyUserHeader}
}

func (s *Server) loginPage(w http.ResponseWriter, r *http.Request) {
	next := safeNext(r.URL.Query().Get("next"))
	if s.auth.identify(r) != nil {
		http.Redirect(w, r, next, http.StatusSeeOther)
		return
	}
	s.render(w, r, http.StatusOK, "login", view{Title: "Sign in", Data: s.loginData(next, "")})
}

func (s *Server) login(w http.ResponseWriter, r *http.Request) {
	r.Body = http.MaxBytesReader(w, r.Body, maxFormBytes)
	if err := r.ParseForm(); err != nil {
		http.Error(w, "bad form", http.StatusBadRequest)
		return
	}
	if !cleanValues(r.PostForm) {
		http.Error(w, badBytes, http.StatusBadRequest)
		return
	}
	next := safeNext(r.PostForm.Get("next"))
	name := strings.TrimSpace(r.PostForm.Get("name"))
	if len(name) > maxNameBytes {
		name = name[:maxNameBytes]
	}
	at, status, wait := s.auth.admitAttempt(r, name)
	if status != 0 {
		msg := "too many sign-in attempts from your address or for this account; wait " + humanDuration(wait.Round(time.Second)) + " and try again"
		if status == http.StatusServiceUnavailable {
			msg = "the server is busy checking other sign-ins; try again in a moment"
		}
		s.cfg.Logger.Warn("keel web: sign-in refused", "name", name, "client", at.addr, "status", status)
		w.Header().Set("Retry-After", strconv.Itoa(max(int(wait.Round(time.Second).Seconds()), 1)))
		s.render(w, r, status, "login", view{Title: "Sign in", Error: msg, Data: s.loginData(next, name)})
		return
	}
	u, ok := s.auth.tryPassword(at, name, r.PostForm.Get("password"))
	if !ok {
		s.cfg.Logger.Warn("keel web: failed sign-in", "name", name, "client", at.addr, "remote", r.RemoteAddr)
		s.audit(r.Context(), "", "sign-in-failed", name, "from "+at.addr)
		s.render(w, r, http.StatusUnauthorized, "login", view{Title: "Sign in",
			Error: "wrong name or password", Data: s.loginData(next, name)})
		return
	}
	http.SetCookie(w, s.auth.issue(u))
	http.SetCookie(w, s.auth.issueDevice(u.Name))
	s.cfg.Logger.Info("keel web: signed in", "name", u.Name, "role", u.Role, "client", at.addr, "remote", r.RemoteAddr)
	s.audit(r.Context(), "", "sign-in", u.Name, "from "+at.addr)
	http.Redirect(w, r, next, http.StatusSeeOther)
}

// maxNameBytes bounds the name a sign-in attempt is counted and logged
// under (validName allows no longer).
const maxNameBytes = 128

func (s *Server) logout(w http.ResponseWriter, r *http.Request) {
	p := principalFrom(r.Context())
	http.SetCookie(w, s.auth.cookie("", time.Time{}))
	if p.sid == "" {
		http.Redirect(w, r, "/login", http.StatusSeeOther)
		return
	}
	if err := s.auth.ended.end(r.Context(), p.sid, p.exp, s.auth.now()); err != nil {
		// This server refuses the session already; the others would not.
		s.errorPage(w, r, http.StatusServiceUnavailable, "Signed out of this server, but the sign-out could not be recorded in the ledger, "+
			"so the session may still work on other replicas until it expires at "+p.exp.UTC().Format("2006-01-02 15:04 UTC")+
			" ("+s.logRef("recording a sign-out failed", r, err)+").")
		return
	}
	s.cfg.Logger.Info("keel web: signed out", "name", p.Name)
	http.Redirect(w, r, "/login", http.StatusSeeOther)
}

// safeNext keeps the after-sign-in redirect on this server. It checks what
// will actually be sent: http.Redirect cleans a path (/./\evil.example
// becomes /\evil.example), so next is cleaned the same way first, and a
// browser reads a backslash in a path as a slash (/\evil.example is
// //evil.example, another host), so none may remain. Anything else becomes
// "/".
func safeNext(next string) string {
	if !strings.HasPrefix(next, "/") || strings.HasPrefix(next, "//") || strings.HasPrefix(next, `/\`) ||
		strings.ContainsFunc(next, func(r rune) bool { return r < 0x20 || r == 0x7f }) {
		return "/"
	}
	// As http.Redirect: the part before "?" is cleaned, a trailing slash kept.
	p, query, hasQuery := strings.Cut(next, "?")
	clean := path.Clean(p)
	if strings.HasSuffix(p, "/") && !strings.HasSuffix(clean, "/") {
		clean += "/"
	}
	if strings.Contains(clean, `\`) || strings.HasPrefix(clean, "//") {
		return "/"
	}
	if hasQuery {
		clean += "?" + query
	}
	u, err := url.Parse(clean)
	if err != nil || u.Scheme != "" || u.Host != "" || u.Opaque != "" {
		return "/"
	}
	return clean
}
