package web

import (
	"crypto/sha256"
	"encoding/base64"
	"fmt"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strconv"
	"strings"

	"github.com/hibiken/asynq"
	"github.com/hibiken/asynqmon"
)

// monitor is one asynqmon handler and the policy its page needs.
type monitor struct {
	h   *asynqmon.HTTPHandler
	csp string
}

// newMonitor builds asynqmon for one role. asynqmon takes its options once,
// so viewers and operators each get their own handler.
func newMonitor(redis asynq.RedisConnOpt, format func(string, []byte) string, readOnly bool) (*monitor, error) {
	h := asynqmon.New(asynqmon.Options{
		RootPath:         MonitoringPath,
		RedisConnOpt:     redis,
		ReadOnly:         readOnly,
		PayloadFormatter: asynqmon.PayloadFormatterFunc(format),
	})
	csp, err := monitorCSP(h)
	if err != nil {
		h.Close()
		return nil, err
	}
	return &monitor{h: h, csp: csp}, nil
}

var inlineScript = regexp.MustCompile(`(?s)<script>(.*?)</script>`)

// monitorCSP is the policy asynqmon's single-page app needs. Its index page
// has two inline scripts (settings and the webpack loader) whose text
// depends on the options, so they are allowed by hash, computed from the
// page itself; the bundle is same-origin. Material-UI injects style
// elements (hence 'unsafe-inline' for styles only), and the page links
// Google's Roboto and Material Icons fonts.
func monitorCSP(h http.Handler) (string, error) {
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, MonitoringPath+"/", nil))
	if rec.Code != http.StatusOK {
		return "", fmt.Errorf("keel web: asynqmon's index page answered %d", rec.Code)
	}
	var hashes []string
	for _, m := range inlineScript.FindAllStringSubmatch(rec.Body.String(), -1) {
		sum := sha256.Sum256([]byte(m[1]))
		hashes = append(hashes, "'sha256-"+base64.StdEncoding.EncodeToString(sum[:])+"'")
	}
	return "default-src 'self'; script-src 'self' " + strings.Join(hashes, " ") + "; " +
		"style-src 'self' 'unsafe-inline' https://fonts.googleapis.com; " +
		"font-src 'self' data: https://fonts.gstatic.com; img-src 'self' data:; connect-src 'self'; " +
		"manifest-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'", nil
}

func (m *monitor) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Security-Policy", m.csp)
	if strings.HasPrefix(r.URL.Path, MonitoringPath+"/api/") {
		w.Header().Set("Cache-Control", "no-store")
	}
	m.h.ServeHTTP(w, r)
}

// monitoring routes a signed-in user to the asynqmon of their role. Viewers
// get the read-only one, and their writes are refused here as well, so the
// role holds even if asynqmon's own check had a gap.
func (s *Server) monitoring(w http.ResponseWriter, r *http.Request) {
	p := principalFrom(r.Context())
	if p.Operator() {
		if safeMethod(r.Method) {
			s.monRW.ServeHTTP(w, r)
			return
		}
		// Every write through asynqmon is audited, under the task's id when
		// it names one (asynq's task id is keel's job id).
		rec := &statusRecorder{ResponseWriter: w, status: http.StatusOK}
		s.monRW.ServeHTTP(rec, r)
		action := "asynqmon " + r.Method + " " + strings.TrimPrefix(r.URL.Path, MonitoringPath+"/api")
		s.audit(r.Context(), taskIDIn(r.URL.Path), clip(action, 300), p.Name, "answered "+strconv.Itoa(rec.status))
		s.cfg.Logger.Info("keel web: asynqmon write", "method", r.Method, "path", r.URL.Path, "actor", p.Name, "status", rec.status)
		return
	}
	if !safeMethod(r.Method) {
		http.Error(w, "operators only: your role is viewer", http.StatusForbidden)
		return
	}
	s.monRO.ServeHTTP(w, r)
}

type statusRecorder struct {
	http.ResponseWriter
	status int
}

func (r *statusRecorder) WriteHeader(code int) {
	r.status = code
	r.ResponseWriter.WriteHeader(code)
}

// taskIDIn finds the task id in an asynqmon API path such as
// /monitoring/api/queues/default/archived_tasks/ID:run.
func taskIDIn(path string) string {
	_, rest, ok := strings.Cut(path, "_tasks/")
	if !ok {
		return ""
	}
	id, _, _ := strings.Cut(rest, ":")
	if strings.Contains(id, "/") {
		return ""
	}
	return id
}
