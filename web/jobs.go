package web

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/ledger"
)

// statusInDoubt is the jobs list's filter for jobs waiting on a person's
// verdict about a step: a step started and never recorded done, which no
// Verify of its handler can settle, on a job pending, failed, dead, paused
// or cancelled (a running job's started step is a call in progress; a
// cancelled job's stays on its page, for the record), or a dead job whose
// error says it is in doubt.
const statusInDoubt = "in-doubt"

var listStatuses = []string{
	string(idempotency.StatusWaiting), string(idempotency.StatusPending), string(idempotency.StatusPaused), string(idempotency.StatusRunning),
	string(idempotency.StatusFailed), string(idempotency.StatusDead), string(idempotency.StatusSucceeded), string(idempotency.StatusDiscarded),
	string(idempotency.StatusCancelled), statusInDoubt,
}

// refreshChoices are the auto-refresh periods the list offers, in seconds.
// Refreshing is a <meta http-equiv="refresh">: keel's pages keep running
// no script at all.
var refreshChoices = []int{5, 10, 30, 60}

// jobFilter is the jobs list's filter as typed into its form.
type jobFilter struct {
	Status, Kind, Queue, Prefix, Error string
	Batch                              string // a batch's members only
	Oldest                             bool   // oldest first; default newest first
	From                               string // keyset cursor: the last id of the previous page
	Refresh                            int
}

func (f jobFilter) values() url.Values {
	v := url.Values{}
	for k, s := range map[string]string{"status": f.Status, "kind": f.Kind, "queue": f.Queue, "prefix": f.Prefix,
		"error": f.Error, "batch": f.Batch, "from": f.From} {
		if s != "" {
			v.Set(k, s)
		}
	}
	if f.Oldest {
		v.Set("sort", "oldest")
	}
	if f.Refresh > 0 {
		v.Set("refresh", strconv.Itoa(f.Refresh))
	}
	return v
}

// Empty reports whether the filter selects every job.
func (f jobFilter) Empty() bool {
	return f.Status == "" && f.Kind == "" && f.Queue == "" && f.Prefix == "" && f.Error == "" && f.Batch == ""
}

func readJobFilter(q url.Values) (jobFilter, error) {
	q = maps.Clone(q)
	if err := tooLong(q, "status", "kind", "queue", "prefix", "error", "batch", "from", "sort", "refresh"); err != nil {
		return jobFilter{}, err
	}
	f := jobFilter{Status: strings.TrimSpace(q.Get("status")), Kind: strings.TrimSpace(q.Get("kind")),
		Queue: strings.TrimSpace(q.Get("queue")), Prefix: q.Get("prefix"), Error: strings.TrimSpace(q.Get("error")),
		Batch: strings.TrimSpace(q.Get("batch")), From: strings.TrimSpace(q.Get("from"))}
	switch q.Get("sort") {
	case "", "newest":
	case "oldest":
		f.Oldest = true
	default:
		return f, errors.New("sort: want newest or oldest")
	}
	if f.Status != "" && !slices.Contains(listStatuses, f.Status) {
		return f, fmt.Errorf("status %q: want one of %s", f.Status, strings.Join(listStatuses, ", "))
	}
	if r := q.Get("refresh"); r != "" && r != "0" {
		n, err := strconv.Atoi(r)
		if err != nil || !slices.Contains(refreshChoices, n) {
			return f, fmt.Errorf("refresh %q: want one of %v seconds", r, refreshChoices)
		}
		f.Refresh = n
	}
	return f, nil
}

// listRow is what the jobs list shows of a job.
type listRow struct {
	ID, Kind, BusinessKey, Queue string
	Status                       idempotency.Status
	Attempts, MaxRetry           int
	LastError, ErrorClass        string
	CreatedAt, UpdatedAt         time.Time
	FinishedAt                   *time.Time
	// Superseded: a newer job of the key took this finished one's place.
	Superseded bool
}

// ErrorIsCurrent reports whether the job's last error is why it stands
// where it is (failed, dead) rather than history from an earlier attempt
// of a job that has since moved on.
func (r listRow) ErrorIsCurrent() bool {
	return r.Status == idempotency.StatusFailed || r.Status == idempotency.StatusDead
}

// listJobs reads a page of the ledger after the cursor (ledger.ListJobs).
func listJobs(ctx context.Context, db ledger.DB, f jobFilter, limit int) ([]listRow, bool, error) {
	lf := ledger.JobFilter{Status: ledger.Status(f.Status), InDoubt: f.Status == statusInDoubt, Kind: f.Kind, Queue: f.Queue,
		Prefix: f.Prefix, Error: f.Error, Batch: f.Batch, Oldest: f.Oldest, After: f.From}
	jobs, more, err := ledger.ListJobs(ctx, db, lf, limit)
	if err != nil {
		return nil, false, err
	}
	out := make([]listRow, len(jobs))
	for i, j := range jobs {
		out[i] = listRow{ID: j.ID, Kind: j.Kind, BusinessKey: j.BusinessKey, Queue: j.Queue,
			Status: j.Status, Attempts: j.Attempts, MaxRetry: j.MaxRetry,
			LastError: j.LastError, ErrorClass: j.ErrorClass, CreatedAt: j.CreatedAt, UpdatedAt: j.UpdatedAt,
			FinishedAt: j.FinishedAt, Superseded: j.Superseded}
		if j.Superseded {
			out[i].BusinessKey = ledger.OriginalKey(j.BusinessKey, j.ID)
		}
	}
	return out, more, nil
}

type jobsData struct {
	Filter         jobFilter
	Statuses       []string
	RefreshChoices []int
	Rows           []listRow
	FirstURL       string
	NextURL        string
	Selectable     bool // some row is dead: replay and discard apply
	Cancellable    bool // some row is not finished: cancel applies
}

// jobsList is the jobs list: every job in the ledger, filtered.
func (s *Server) jobsList(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), pageTimeout)
	defer cancel()
	f, err := readJobFilter(r.URL.Query())
	d := jobsData{Filter: f, Statuses: listStatuses, RefreshChoices: refreshChoices}
	title := "Jobs"
	if err != nil {
		s.render(w, r, http.StatusBadRequest, "jobs", view{Title: title, Nav: "jobs", Error: err.Error(), Data: d})
		return
	}
	rows, more, err := listJobs(ctx, s.cfg.Pool, f, s.cfg.PageSize)
	if err != nil {
		s.ledgerError(w, r, err)
		return
	}
	d.Rows = rows
	for _, row := range rows {
		if row.Status == idempotency.StatusDead {
			d.Selectable = true
		}
		if cancellable(row.Status) {
			d.Cancellable = true
		}
	}
	if f.From != "" {
		first := f
		first.From = ""
		d.FirstURL = "/jobs?" + first.values().Encode()
	}
	if more {
		next := f
		next.From = rows[len(rows)-1].ID
		d.NextURL = "/jobs?" + next.values().Encode()
	}
	s.render(w, r, http.StatusOK, "jobs", view{Title: title, Nav: "jobs", Refresh: f.Refresh, Data: d})
}

// prettyPayload lays a JSON payload out readably: indented, and with the
// characters encoding/json escapes for HTML (<, >, &) shown as themselves —
// the page escapes them for HTML anyway. Anything else is shown as it is.
func prettyPayload(s string) string {
	if !json.Valid([]byte(s)) {
		return s
	}
	var b bytes.Buffer
	if err := json.Indent(&b, []byte(s), "", "  "); err != nil {
		return s
	}
	return unescapeHTMLEscapes(b.String())
}

// unescapeHTMLEscapes turns \u003c, \u003e and \u0026 escapes in JSON
// text back into <, > and &, leaving every other escape (\\u003c is a
// backslash and text) alone.
func unescapeHTMLEscapes(s string) string {
	if !strings.Contains(s, `\u00`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c != '\\' || i+1 >= len(s) {
			b.WriteByte(c)
			continue
		}
		if s[i+1] == 'u' && i+6 <= len(s) {
			switch strings.ToLower(s[i+2 : i+6]) {
			case "003c":
				b.WriteByte('<')
				i += 5
				continue
			case "003e":
				b.WriteByte('>')
				i += 5
				continue
			case "0026":
				b.WriteByte('&')
				i += 5
				continue
			}
		}
		b.WriteString(s[i : i+2])
		i++
	}
	return b.String()
}
