package web

import (
	"net/http"
	"net/url"
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
	next := safeNext(r.PostForm.Get("next"))
	name := strings.TrimSpace(r.PostForm.Get("name"))
	ip, now := clientIP(r), time.Now()
	if s.auth.failures.blocked(ip, now) {
		s.render(w, r, http.StatusTooManyRequests, "login", view{Title: "Sign in",
			Error: "too many failed sign-ins from your address; wait a few minutes", Data: s.loginData(next, name)})
		return
	}
	u, ok := s.auth.checkPassword(name, r.PostForm.Get("password"))
	if !ok {
		s.auth.failures.fail(ip, now)
		s.cfg.Logger.Warn("keel web: failed sign-in", "name", name, "remote", r.RemoteAddr)
		s.render(w, r, http.StatusUnauthorized, "login", view{Title: "Sign in",
			Error: "wrong name or password", Data: s.loginData(next, name)})
		return
	}
	s.auth.failures.reset(ip)
	http.SetCookie(w, s.auth.issue(u))
	s.cfg.Logger.Info("keel web: signed in", "name", u.Name, "role", u.Role, "remote", r.RemoteAddr)
	http.Redirect(w, r, next, http.StatusSeeOther)
}

func (s *Server) logout(w http.ResponseWriter, r *http.Request) {
	p := principalFrom(r.Context())
	s.auth.revoke(p.sid)
	http.SetCookie(w, s.auth.cookie("", time.Time{}))
	http.Redirect(w, r, "/login", http.StatusSeeOther)
}

// safeNext keeps the after-sign-in redirect on this server: a path, never
// another host (//evil.example, /\evil.example).
func safeNext(next string) string {
	if next == "" || !strings.HasPrefix(next, "/") || strings.HasPrefix(next, "//") || strings.HasPrefix(next, "/\\") ||
		strings.ContainsAny(next, "\r\n\t") {
		return "/"
	}
	u, err := url.Parse(next)
	if err != nil || u.Scheme != "" || u.Host != "" {
		return "/"
	}
	return next
}
