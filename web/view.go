package web

import (
	"bytes"
	"crypto/rand"
	"embed"
	"encoding/hex"
	"fmt"
	"html/template"
	"math"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/visible"
)

//go:embed templates/*.html
var templateFS embed.FS

//go:embed keel.css
var stylesheet string

// pages holds the parsed templates, one set per page.
type pages struct {
	css template.CSS
	set map[string]*template.Template
}

var pageNames = []string{"login", "overview", "dead", "lookup", "jobs", "job", "confirm", "bulk", "error", "batches", "batch", "workflow", "schedules", "retention", "pauses", "keys"}

// pageParts are the templates a page includes besides the layout and its
// own: sections kept in files of their own.
var pageParts = map[string][]string{"job": {"templates/job_deps.html"}}

func newPages() (*pages, error) {
	p := &pages{css: template.CSS(stylesheet), set: map[string]*template.Template{}}
	for _, name := range pageNames {
		files := append([]string{"templates/layout.html", "templates/" + name + ".html"}, pageParts[name]...)
		t, err := template.New(name).Funcs(funcs).ParseFS(templateFS, files...)
		if err != nil {
			return nil, fmt.Errorf("keel web: template %s: %w", name, err)
		}
		p.set[name] = t
	}
	return p, nil
}

// view is what every page template gets; Data is the page's own.
type view struct {
	Title string
	Nav   string
	User  *principal
	CSS   template.CSS
	Flash string
	Error string
	// Refresh, when positive, makes the page reload itself every Refresh
	// seconds (a meta refresh: no script).
	Refresh int
	Now     time.Time
	Data    any
}

// render writes a page. Everything a job carries reaches the page through
// html/template, which escapes it for its context.
func (s *Server) render(w http.ResponseWriter, r *http.Request, status int, name string, v view) {
	v.CSS = s.pages.css
	v.User = principalFrom(r.Context())
	v.Now = time.Now().UTC()
	var buf bytes.Buffer
	if err := s.pages.set[name].ExecuteTemplate(&buf, "layout", v); err != nil {
		s.cfg.Logger.Error("keel web: rendering a page failed", "page", name, "err", err)
		http.Error(w, "internal error rendering the page", http.StatusInternalServerError)
		return
	}
	h := w.Header()
	h.Set("Content-Type", "text/html; charset=utf-8")
	h.Set("Cache-Control", "no-store")
	w.WriteHeader(status)
	_, _ = w.Write(buf.Bytes())
}

func (s *Server) errorPage(w http.ResponseWriter, r *http.Request, status int, msg string) {
	s.render(w, r, status, "error", view{Title: http.StatusText(status), Error: msg})
}

// ledgerError answers a page the ledger could not give: Postgres's errors
// name the database, its user and host, which are the server's log's to
// know, not every viewer's. The page gives the log line's reference.
func (s *Server) ledgerError(w http.ResponseWriter, r *http.Request, err error) {
	s.errorPage(w, r, http.StatusServiceUnavailable,
		"The ledger (Postgres) could not be read; the server's log says why ("+s.logRef("reading the ledger failed", r, err)+").")
}

// logRef logs err under a fresh reference and returns "ref X" for the page.
func (s *Server) logRef(msg string, r *http.Request, err error) string {
	ref := randomHex(4)
	s.cfg.Logger.Error("keel web: "+msg, "ref", ref, "path", r.URL.Path, "err", err)
	return "ref " + ref
}

// randomHex is n random bytes in hex: an identifier no one can guess.
func randomHex(n int) string {
	raw := make([]byte, n)
	_, _ = rand.Read(raw)
	return hex.EncodeToString(raw)
}

var funcs = template.FuncMap{
	"ts": func(t time.Time) string {
		if t.IsZero() {
			return "—"
		}
		return t.UTC().Format("2006-01-02 15:04:05") + " UTC"
	},
	"tsp": func(t *time.Time) string {
		if t == nil || t.IsZero() {
			return "—"
		}
		return t.UTC().Format("2006-01-02 15:04:05") + " UTC"
	},
	"ago":  ago,
	"agop": func(t *time.Time) string { return agoPtr(t) },
	"dur":  humanDuration,
	"rate": func(f float64) string { return strconv.FormatFloat(f, 'f', 1, 64) },
	"clip": clip,
	// firstLine is the line a list shows of an error.
	"firstLine": func(s string) string {
		line, _, _ := strings.Cut(strings.TrimSpace(s), "\n")
		return line
	},
	"add":     func(a, b int) int { return a + b },
	"bytestr": func(b []byte) string { return clip(string(b), 200) },
	"vis":     visible.Text,
	// The key a step's call carries: what a person looks up at the other
	// system to say whether a call in doubt happened.
	"stepKey": idempotency.StepKey,
}

func ago(t time.Time) string {
	if t.IsZero() {
		return ""
	}
	d := time.Since(t)
	if d < 0 {
		return "in " + humanDuration(-d)
	}
	return humanDuration(d) + " ago"
}

func agoPtr(t *time.Time) string {
	if t == nil {
		return ""
	}
	return ago(*t)
}

func humanDuration(d time.Duration) string {
	switch {
	case d < time.Second:
		return "0s"
	case d < time.Minute:
		return fmt.Sprintf("%ds", int(d.Seconds()))
	case d < time.Hour:
		return fmt.Sprintf("%dm%02ds", int(d.Minutes()), int(d.Seconds())%60)
	case d < 48*time.Hour:
		return fmt.Sprintf("%dh%02dm", int(d.Hours()), int(d.Minutes())%60)
	}
	return fmt.Sprintf("%dd%02dh", int(d.Hours())/24, int(d.Hours())%24)
}

// clip shortens s to at most n runes, marking the cut.
func clip(s string, n int) string {
	if r := []rune(s); len(r) > n {
		return string(r[:n]) + "…"
	}
	return s
}

// chart is a line chart drawn as inline SVG: the plot is W×H, and a band
// below it (to FullH) holds the time axis's labels.
type chart struct {
	W, H, FullH int
	Lines       []chartLine
	Max         string // the value at the top edge
	Span        string // how much time the x axis covers
	Ticks       []tick // the time axis
	Empty       bool
}

// tick is a mark on a chart's time axis.
type tick struct {
	X      float64
	Label  string // "-45m", …, "now"
	Anchor string // the label's text-anchor
}

// axisBand is the height below a chart's plot that holds its axis labels.
const axisBand = 18

type chartLine struct {
	Class, Label string
	Points       string // "x,y x,y …" for <polyline>
}

// lineChart plots series (sharing the time axis ts) over the time that ends
// now: the last hour, or less while the server has not sampled that long,
// so that a fresh server's charts are not a sliver at the right edge. Values
// are scaled to the largest one.
func lineChart(w, h int, maxWindow time.Duration, now time.Time, ts []time.Time, series []chartLine, values [][]float64) chart {
	c := chart{W: w, H: h, FullH: h + axisBand, Empty: len(ts) < 2}
	window := maxWindow
	if len(ts) > 0 {
		window = min(max(now.Sub(ts[0]), time.Minute), maxWindow)
	}
	c.Span = "last hour"
	if window < maxWindow {
		c.Span = fmt.Sprintf("last %d min", int(window.Round(time.Minute).Minutes()))
	}
	for i := range 5 {
		t := tick{X: float64(w) * float64(i) / 4, Label: "now", Anchor: "middle"}
		if i < 4 {
			t.Label = "-" + humanDuration(window*time.Duration(4-i)/4)
		}
		switch i {
		case 0:
			t.Anchor = "start"
		case 4:
			t.Anchor = "end"
		}
		c.Ticks = append(c.Ticks, t)
	}
	top := 0.0
	for _, vs := range values {
		for _, v := range vs {
			top = math.Max(top, v)
		}
	}
	if top == 0 {
		top = 1
	}
	c.Max = strconv.FormatFloat(top, 'g', 3, 64)
	start := now.Add(-window)
	for i, vs := range values {
		var b strings.Builder
		for j, v := range vs {
			x := float64(w) * ts[j].Sub(start).Seconds() / window.Seconds()
			y := float64(h-2) - (float64(h-4) * v / top)
			if x < 0 {
				continue
			}
			fmt.Fprintf(&b, "%.1f,%.1f ", x, y)
		}
		l := series[i]
		l.Points = strings.TrimSpace(b.String())
		c.Lines = append(c.Lines, l)
	}
	return c
}

// bars is a small bar chart of daily totals.
type bars struct {
	W, H int
	Bars []bar
	Max  int
}

type bar struct {
	X, W             float64
	YTotal, HTotal   float64
	YFailed, HFailed float64
	Label            string
}

func barChart(w, h int, days []dayStat) bars {
	b := bars{W: w, H: h}
	for _, d := range days {
		b.Max = max(b.Max, d.Processed)
	}
	top := float64(max(b.Max, 1))
	slot := float64(w) / float64(max(len(days), 1))
	for i, d := range days {
		hp := float64(h-2) * float64(d.Processed) / top
		hf := float64(h-2) * float64(d.Failed) / top
		b.Bars = append(b.Bars, bar{
			X: float64(i)*slot + 1, W: slot - 2,
			YTotal: float64(h) - hp, HTotal: hp,
			YFailed: float64(h) - hf, HFailed: hf,
			Label: fmt.Sprintf("%s: %d processed, %d failed", d.Date.Format("Mon 2 Jan"), d.Processed, d.Failed),
		})
	}
	return b
}

type dayStat struct {
	Date              time.Time
	Processed, Failed int
}
