package web

import (
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"unicode/utf8"
)

// securityHeaders sets the headers every response carries. Keel's pages run
// no script at all; asynqmon's handler replaces the policy with its own.
func (s *Server) securityHeaders(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h := w.Header()
		h.Set("Content-Security-Policy", s.pageCSP)
		h.Set("X-Content-Type-Options", "nosniff")
		h.Set("X-Frame-Options", "DENY")
		h.Set("Referrer-Policy", "same-origin")
		h.Set("Cross-Origin-Opener-Policy", "same-origin")
		h.Set("Cross-Origin-Resource-Policy", "same-origin")
		h.Set("Permissions-Policy", "camera=(), microphone=(), geolocation=(), payment=()")
		if r.TLS != nil {
			h.Set("Strict-Transport-Security", "max-age=31536000")
		}
		next.ServeHTTP(w, r)
	})
}

// pageCSP is the policy of keel's own pages: no script, the one inline
// stylesheet by hash, forms and images from this origin only.
func pageCSP(css string) string {
	sum := sha256.Sum256([]byte(css))
	return "default-src 'none'; style-src 'sha256-" + base64.StdEncoding.EncodeToString(sum[:]) + "'; " +
		"img-src 'self' data:; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
}

func safeMethod(m string) bool { return m == http.MethodGet || m == http.MethodHead }

// sameOrigin refuses every state-changing request that a browser did not
// send from one of this server's own pages. It is what protects asynqmon's
// API, whose script cannot carry keel's form token: its fetch calls always
// carry Origin (and Sec-Fetch-Site), which another site cannot forge.
// Requests with neither Origin nor Referer are refused too.
func (s *Server) sameOrigin(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !safeMethod(r.Method) && !s.fromOwnOrigin(r) {
			s.cfg.Logger.Warn("keel web: cross-origin request refused", "method", r.Method, "path", r.URL.Path,
				"origin", r.Header.Get("Origin"), "remote", r.RemoteAddr)
			http.Error(w, "cross-origin request refused", http.StatusForbidden)
			return
		}
		next.ServeHTTP(w, r)
	})
}

func (s *Server) ownOrigin(r *http.Request) string {
	if s.origin != "" {
		return s.origin
	}
	scheme := "http"
	if r.TLS != nil || s.cfg.BehindHTTPS {
		scheme = "https"
	}
	return scheme + "://" + strings.ToLower(r.Host)
}

func (s *Server) fromOwnOrigin(r *http.Request) bool {
	if site := r.Header.Get("Sec-Fetch-Site"); site != "" && site != "same-origin" {
		return false
	}
	want := s.ownOrigin(r)
	if o := r.Header.Get("Origin"); o != "" {
		return strings.EqualFold(o, want)
	}
	ref, err := url.Parse(r.Header.Get("Referer"))
	if err != nil || ref.Host == "" {
		return false
	}
	return strings.EqualFold(ref.Scheme+"://"+ref.Host, want)
}

// maxFormBytes bounds what a form post may send (notes are short).
const maxFormBytes = 64 << 10

// checkToken refuses a form post without this user's token: a second line
// of defence behind sameOrigin for keel's own actions.
func checkToken(next http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		p := principalFrom(r.Context())
		r.Body = http.MaxBytesReader(w, r.Body, maxFormBytes)
		if err := r.ParseForm(); err != nil {
			http.Error(w, "bad form", http.StatusBadRequest)
			return
		}
		if !cleanValues(r.PostForm) {
			http.Error(w, badBytes, http.StatusBadRequest)
			return
		}
		if utf8.RuneCountInString(r.PostForm.Get("note")) > MaxNoteChars {
			http.Error(w, fmt.Sprintf("the note is longer than %d characters", MaxNoteChars), http.StatusBadRequest)
			return
		}
		if p == nil || subtle.ConstantTimeCompare([]byte(r.PostForm.Get("csrf")), []byte(p.csrf)) != 1 {
			http.Error(w, "missing or stale form token: reload the page and try again", http.StatusForbidden)
			return
		}
		next(w, r)
	}
}

// operatorOnly refuses viewers.
func operatorOnly(next http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if !principalFrom(r.Context()).Operator() {
			http.Error(w, "operators only: your role is viewer", http.StatusForbidden)
			return
		}
		next(w, r)
	}
}
