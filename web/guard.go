package web

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"strings"
	"time"
	"unicode/utf8"
)

// hostPolicy is the Host headers the server answers to. A DNS-rebinding
// page reaches a loopback server under the attacker's own name, with a
// matching Origin; refusing unknown names is what stops it.
type hostPolicy struct {
	names map[string]bool
	anyIP bool // listening on every interface: any address literal
}

func newHostPolicy(cfg Config, origin string) hostPolicy {
	p := hostPolicy{names: map[string]bool{"localhost": true, "127.0.0.1": true, "::1": true}}
	if host, _, err := net.SplitHostPort(cfg.Addr); err == nil {
		if ip := net.ParseIP(host); host == "" || (ip != nil && ip.IsUnspecified()) {
			p.anyIP = true
		} else {
			p.names[hostName(host)] = true
		}
	}
	if origin != "" {
		if u, err := url.Parse(origin); err == nil {
			p.names[hostName(u.Host)] = true
		}
	}
	for _, h := range cfg.AllowedHosts {
		p.names[hostName(h)] = true
	}
	return p
}

// hostName is a Host header's name: lower case, without port, brackets or
// a trailing dot.
func hostName(h string) string {
	h = strings.TrimSpace(h)
	if host, _, err := net.SplitHostPort(h); err == nil {
		h = host
	}
	return strings.TrimSuffix(strings.ToLower(strings.Trim(h, "[]")), ".")
}

func validAllowedHost(h string) error {
	h = strings.TrimSpace(h)
	if h == "" || strings.ContainsAny(h, "/@ \t\r\n") || (strings.Contains(h, ":") && net.ParseIP(strings.Trim(h, "[]")) == nil) {
		return fmt.Errorf("keel web: allowed host %q: want a host name or IP address, without scheme or port", h)
	}
	return nil
}

func (p hostPolicy) allows(host string) bool {
	name := hostName(host)
	if name == "" {
		return false
	}
	return p.names[name] || (p.anyIP && net.ParseIP(name) != nil)
}

// checkHost refuses requests for a host the server does not answer to.
// /healthz and /metrics stay open to probes and scrapers that address the
// server by a service name: a session cannot be had from such a name.
func (s *Server) checkHost(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/healthz" && r.URL.Path != "/metrics" && !s.hosts.allows(r.Host) {
			s.cfg.Logger.Warn("keel web: request for an unknown host refused", "host", r.Host, "path", r.URL.Path, "remote", r.RemoteAddr)
			http.Error(w, "this server does not answer to host "+fmt.Sprintf("%q", hostName(r.Host))+
				"; open it by the address it listens on, or add the name with --origin or --allowed-host", http.StatusMisdirectedRequest)
			return
		}
		next.ServeHTTP(w, r)
	})
}

const badBytes = "a parameter holds a NUL byte or is not valid UTF-8"

// maxParamBytes bounds a filter or look-up parameter: longer ones are
// refused, and never echoed back into the page.
const maxParamBytes = 512

// tooLong returns an error naming the first of the parameters names in v
// longer than maxParamBytes, after deleting every such one from v so that
// a page built from v does not echo it.
func tooLong(v url.Values, names ...string) error {
	var err error
	for _, n := range names {
		if len(v.Get(n)) > maxParamBytes {
			if err == nil {
				err = fmt.Errorf("%s: at most %d bytes", n, maxParamBytes)
			}
			v.Del(n)
		}
	}
	return err
}

func cleanText(s string) bool { return utf8.ValidString(s) && !strings.ContainsRune(s, 0) }

func cleanValues(v url.Values) bool {
	for k, vs := range v {
		if !cleanText(k) {
			return false
		}
		for _, s := range vs {
			if !cleanText(s) {
				return false
			}
		}
	}
	return true
}

// cleanRequest refuses paths and query parameters the ledger cannot hold
// (Postgres text takes neither NUL nor invalid UTF-8) with 400, before they
// reach a query.
func cleanRequest(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !cleanText(r.URL.Path) || !cleanValues(r.URL.Query()) {
			http.Error(w, badBytes, http.StatusBadRequest)
			return
		}
		next.ServeHTTP(w, r)
	})
}

// audit writes what a person did to the ledger's audit log; jobID is empty
// for what concerns no job (sign-ins, queue actions in asynqmon). A failure
// to write is logged, not fatal to the request.
func (s *Server) audit(ctx context.Context, jobID, action, actor, note string) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	if err := s.ops.Record(ctx, jobID, action, actor, note); err != nil {
		s.cfg.Logger.Error("keel web: writing the audit log failed", "action", action, "actor", actor, "job_id", jobID, "err", err)
	}
}
