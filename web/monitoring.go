package web

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"path"
	"regexp"
	"strconv"
	"strings"

	"github.com/hibiken/asynq"
	"github.com/hibiken/asynqmon"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/visible"
)

// monitor is one asynqmon handler, its index page as keel serves it and
// the policy that page needs.
type monitor struct {
	h     *asynqmon.HTTPHandler
	raw   []byte // asynqmon's own index page
	index []byte
	csp   string
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
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, MonitoringPath+"/", nil))
	if rec.Code != http.StatusOK {
		h.Close()
		return nil, fmt.Errorf("keel web: asynqmon's index page answered %d", rec.Code)
	}
	index := monitorIndex(rec.Body.String())
	return &monitor{h: h, raw: rec.Body.Bytes(), index: []byte(index), csp: monitorCSP(index)}, nil
}

var (
	inlineScript = regexp.MustCompile(`(?s)<script>(.*?)</script>`)
	// foreignLink is a stylesheet from another site: asynqmon's index links
	// Google's Roboto and Material Icons fonts.
	foreignLink = regexp.MustCompile(`<link[^>]*href="https?://[^"]*"[^>]*>`)
)

// backLink leads from asynqmon back to keel's pages. It sits in the free
// right end of asynqmon's top bar (64 px high, above the app's z-index of
// 1100), not over the page, whose tables reach every corner.
const backLink = `<a id="keel-back" href="/" title="keel: jobs, dead letters" style="position:fixed;right:16px;top:14px;z-index:1300;` +
	`padding:7px 14px;border-radius:18px;background:#14213d;color:#fff;font:14px/20px system-ui,sans-serif;` +
	`text-decoration:none;box-shadow:0 1px 4px rgba(0,0,0,.3)">← keel</a>`

// monitorIndex is asynqmon's index page as keel serves it: nothing loaded
// from another site (the system's fonts stand in for Roboto), and a link
// back to keel.
func monitorIndex(page string) string {
	page = foreignLink.ReplaceAllString(page, "")
	return strings.Replace(page, "</body>", backLink+"</body>", 1)
}

// monitorCSP is the policy asynqmon's single-page app needs. Its index page
// has two inline scripts (settings and the webpack loader) whose text
// depends on the options, so they are allowed by hash, computed from the
// page itself; the bundle is same-origin. Material-UI injects style
// elements (hence 'unsafe-inline' for styles only). Nothing comes from
// another site.
func monitorCSP(index string) string {
	var hashes []string
	for _, m := range inlineScript.FindAllStringSubmatch(index, -1) {
		sum := sha256.Sum256([]byte(m[1]))
		hashes = append(hashes, "'sha256-"+base64.StdEncoding.EncodeToString(sum[:])+"'")
	}
	return "default-src 'self'; script-src 'self' " + strings.Join(hashes, " ") + "; " +
		"style-src 'self' 'unsafe-inline'; font-src 'self' data:; img-src 'self' data:; connect-src 'self'; " +
		"manifest-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
}

func (m *monitor) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Security-Policy", m.csp)
	rest := strings.TrimPrefix(r.URL.Path, MonitoringPath)
	switch {
	case strings.HasPrefix(rest, "/api/"):
		w.Header().Set("Cache-Control", "no-store")
		if safeMethod(r.Method) {
			m.serveShown(w, r)
			return
		}
	case safeMethod(r.Method) && !strings.HasPrefix(rest, "/static/") && path.Ext(rest) == "":
		// A page of the app: asynqmon answers every one with its index.
		m.serveIndex(w)
		return
	case safeMethod(r.Method):
		// A file of the app's, or a page whose path has a dot in it (queue
		// names may): asynqmon answers what is not a file of its own with
		// its index, which must be keel's too.
		rec := httptest.NewRecorder()
		m.h.ServeHTTP(rec, r)
		if bytes.Equal(rec.Body.Bytes(), m.raw) {
			m.serveIndex(w)
			return
		}
		copyResponse(w, rec, rec.Body.Bytes())
		return
	}
	m.h.ServeHTTP(w, r)
}

func (m *monitor) serveIndex(w http.ResponseWriter) {
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store")
	_, _ = w.Write(m.index)
}

// serveShown answers a read of asynqmon's API with every string in it
// passed through visible.Text: the app renders kind names, payloads, errors
// and queue names as they come, so a name with U+202E would read reversed
// there.
func (m *monitor) serveShown(w http.ResponseWriter, r *http.Request) {
	rec := httptest.NewRecorder()
	m.h.ServeHTTP(rec, r)
	body := rec.Body.Bytes()
	// asynqmon writes JSON without saying so (the recorder sniffs text/plain).
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.UseNumber()
	var v any
	if rec.Code == http.StatusOK && dec.Decode(&v) == nil && !dec.More() {
		rec.Header().Set("Content-Type", "application/json")
		if shown, changed := showJSON(v); changed {
			if b, err := json.Marshal(shown); err == nil {
				body = append(b, '\n')
			}
		}
	}
	copyResponse(w, rec, body)
}

// showJSON returns v with visible.Text applied to every string, keys
// included, and whether anything changed.
func showJSON(v any) (any, bool) {
	switch v := v.(type) {
	case string:
		s := visible.Text(v)
		return s, s != v
	case []any:
		changed := false
		for i, e := range v {
			var c bool
			v[i], c = showJSON(e)
			changed = changed || c
		}
		return v, changed
	case map[string]any:
		changed := false
		for k, e := range v {
			e, c := showJSON(e)
			if sk := visible.Text(k); sk != k {
				delete(v, k)
				k, c = sk, true
			}
			v[k] = e
			changed = changed || c
		}
		return v, changed
	}
	return v, false
}

// copyResponse writes a recorded response with body.
func copyResponse(w http.ResponseWriter, rec *httptest.ResponseRecorder, body []byte) {
	h := w.Header()
	for k, vs := range rec.Header() {
		if k == "Content-Security-Policy" || k == "Content-Length" {
			continue
		}
		h[k] = vs
	}
	w.WriteHeader(rec.Code)
	_, _ = w.Write(body)
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
		if !s.runThroughKeel(rec, r, p) && !s.cancelThroughKeel(rec, r, p) && !s.archiveThroughKeel(rec, r) && !s.pauseThroughKeel(rec, r, p) {
			s.monRW.ServeHTTP(rec, r)
		}
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

// runThroughKeel takes over asynqmon's "run" of archived tasks. An archived
// task of a keel job is a dead letter: running it in asynq would run the
// handler while the ledger still says dead, so keel replays it instead
// (through the ledger, with the audit entry). Tasks keel does not know are
// left to asynqmon. It reports whether it answered.
func (s *Server) runThroughKeel(w http.ResponseWriter, r *http.Request, p *principal) bool {
	rest, ok := strings.CutPrefix(r.URL.Path, MonitoringPath+"/api/queues/")
	if !ok || r.Method != http.MethodPost {
		return false
	}
	queue, action, ok := strings.Cut(rest, "/archived_tasks")
	if !ok || strings.Contains(queue, "/") {
		return false
	}
	switch {
	case action == ":run_all":
		http.Error(w, "keel: archived tasks of keel jobs are dead letters; replay them from keel's dead letters page (/dead), "+
			"which runs them again through the ledger", http.StatusConflict)
		return true
	case action == ":batch_run":
		var req struct {
			TaskIDs []string `json:"task_ids"`
		}
		if err := json.NewDecoder(io.LimitReader(r.Body, maxFormBytes)).Decode(&req); err != nil {
			http.Error(w, "bad request: "+err.Error(), http.StatusBadRequest)
			return true
		}
		resp := struct {
			PendingIDs []string `json:"pending_ids"`
			ErrorIDs   []string `json:"error_ids"`
		}{PendingIDs: []string{}, ErrorIDs: []string{}}
		for _, id := range req.TaskIDs {
			known, err := s.replayFromMonitor(r.Context(), id, p)
			if !known {
				err = s.insp.RunTask(queue, id)
			}
			if err != nil {
				resp.ErrorIDs = append(resp.ErrorIDs, id)
				continue
			}
			resp.PendingIDs = append(resp.PendingIDs, id)
		}
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(resp)
		return true
	case strings.HasPrefix(action, "/") && strings.HasSuffix(action, ":run"):
		id := strings.TrimSuffix(strings.TrimPrefix(action, "/"), ":run")
		known, err := s.replayFromMonitor(r.Context(), id, p)
		return answerMonitorAction(w, id, known, err)
	}
	return false
}

// answerMonitorAction answers asynqmon's action on one task that keel took
// over; false when the task is no keel job and asynqmon should act itself.
func answerMonitorAction(w http.ResponseWriter, id string, known bool, err error) bool {
	if !known {
		return false
	}
	if err != nil {
		http.Error(w, "keel: "+err.Error()+"; see the job's page, /jobs/"+url.PathEscape(id), http.StatusConflict)
		return true
	}
	w.WriteHeader(http.StatusNoContent)
	return true
}

// replayFromMonitor replays the keel job id, if there is one.
func (s *Server) replayFromMonitor(ctx context.Context, id string, p *principal) (known bool, err error) {
	if _, err := s.store.Get(ctx, id); errors.Is(err, idempotency.ErrNotFound) {
		return false, nil
	} else if err != nil {
		return true, err
	}
	res, err := s.ops.Replay(ctx, id, p.Name, "run from asynqmon")
	if err == nil && res.AlreadyReplayed {
		err = fmt.Errorf("the ledger says the job is %s, not dead", res.Job.Status)
	}
	if err == nil {
		s.cfg.Logger.Info("keel web: job replayed from asynqmon", "job_id", id, "actor", p.Name)
	}
	return true, err
}
