package web

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"net/url"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/google/uuid"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/inspect"
	"github.com/keeljobs/keel/internal/visible"
	"github.com/keeljobs/keel/metrics"
	"github.com/keeljobs/keel/retry"
)

// pageTimeout bounds the reads behind one page.
const pageTimeout = 10 * time.Second

// bulkSelectTimeout bounds a bulk action's selection, and an action on
// selected jobs, once its browser may have left.
const bulkSelectTimeout = 2 * time.Minute

// chartWindow is what the overview's small charts cover.
const chartWindow = time.Hour

type queueView struct {
	Name          string
	Paused        bool
	Size          map[string]int
	OldestPending time.Duration
	Dead          int
	// Rates per minute over the last minute of samples.
	ProcessedRate, FailedRate float64
	RateChart, DepthChart     chart
	History                   bars
}

type deadKindView struct {
	Queue, Kind, Class string
	N                  int
	URL                string
}

type overviewData struct {
	Queues        []queueView
	RedisErr      string
	LedgerErr     string
	DeadTotal     int
	DeadKinds     []deadKindView
	OutboxBacklog int
	OutboxLag     time.Duration
	Sampling      string
}

func (s *Server) overview(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), pageTimeout)
	defer cancel()
	ledger, err := metrics.NewLedger(metrics.LedgerConfig{Pool: s.cfg.Pool, Inspector: s.insp, Timeout: pageTimeout})
	if err != nil {
		s.errorPage(w, r, http.StatusInternalServerError, "The overview cannot be read ("+s.logRef("reading the overview", r, err)+").")
		return
	}
	snap := ledger.Read(ctx)
	d := overviewData{OutboxBacklog: snap.OutboxBacklog, OutboxLag: snap.OutboxLag,
		Sampling: fmt.Sprintf("sampled every %s by this server", s.cfg.SampleInterval)}
	if snap.RedisErr != nil {
		d.RedisErr = s.logRef("reading Redis failed", r, snap.RedisErr)
	}
	if snap.PostgresErr != nil {
		d.LedgerErr = s.logRef("reading the ledger failed", r, snap.PostgresErr)
	}
	deadByQueue := map[string]int{}
	for _, dc := range snap.Dead {
		deadByQueue[dc.Queue] += dc.N
		d.DeadTotal += dc.N
		d.DeadKinds = append(d.DeadKinds, deadKindView{Queue: dc.Queue, Kind: dc.Kind, Class: dc.Class, N: dc.N,
			URL: "/dead?" + filterForm{Queue: dc.Queue, Kind: dc.Kind, Class: dc.Class}.values().Encode()})
	}
	sort.SliceStable(d.DeadKinds, func(i, j int) bool { return d.DeadKinds[i].N > d.DeadKinds[j].N })
	now := time.Now()
	seen := map[string]bool{}
	for _, q := range snap.Queues {
		seen[q.Name] = true
		d.Queues = append(d.Queues, s.queueView(q, deadByQueue[q.Name], now))
	}
	// Queues Redis no longer knows can still hold dead letters in the ledger.
	for q, n := range deadByQueue {
		if !seen[q] {
			d.Queues = append(d.Queues, queueView{Name: q, Size: map[string]int{}, Dead: n})
		}
	}
	slices.SortFunc(d.Queues, func(a, b queueView) int { return strings.Compare(a.Name, b.Name) })
	s.render(w, r, http.StatusOK, "overview", view{Title: "Overview", Nav: "overview", Data: d})
}

func (s *Server) queueView(q metrics.QueueState, dead int, now time.Time) queueView {
	v := queueView{Name: q.Name, Paused: q.Paused, Size: q.Size, OldestPending: q.OldestPending, Dead: dead}
	ss := s.sampler.series(q.Name)
	rs := rates(ss)
	var n int
	for i := len(rs) - 1; i >= 0 && now.Sub(rs[i].At) <= time.Minute+s.cfg.SampleInterval; i-- {
		v.ProcessedRate += rs[i].Processed
		v.FailedRate += rs[i].Failed
		n++
	}
	if n > 0 {
		v.ProcessedRate /= float64(n)
		v.FailedRate /= float64(n)
	}
	ts := make([]time.Time, len(rs))
	proc := make([]float64, len(rs))
	fail := make([]float64, len(rs))
	for i, p := range rs {
		ts[i], proc[i], fail[i] = p.At, p.Processed, p.Failed
	}
	v.RateChart = lineChart(600, 120, chartWindow, now, ts, []chartLine{
		{Class: "l-processed", Label: "processed/min"}, {Class: "l-failed", Label: "failed/min"}}, [][]float64{proc, fail})
	ts = make([]time.Time, len(ss))
	pend := make([]float64, len(ss))
	act := make([]float64, len(ss))
	for i, p := range ss {
		ts[i], pend[i], act[i] = p.At, float64(p.Pending), float64(p.Active)
	}
	v.DepthChart = lineChart(600, 120, chartWindow, now, ts, []chartLine{
		{Class: "l-pending", Label: "pending"}, {Class: "l-active", Label: "active"}}, [][]float64{pend, act})
	if hist, err := s.insp.History(q.Name, 7); err == nil {
		days := make([]dayStat, len(hist))
		// asynq lists today first; the chart reads left to right.
		for i, h := range hist {
			days[len(hist)-1-i] = dayStat{Date: h.Date, Processed: h.Processed, Failed: h.Failed}
		}
		v.History = barChart(600, 60, days)
	}
	return v
}

// filterForm is the dead-letter filter as typed into the form.
type filterForm struct {
	Kind, Queue, Class, Since, Until string
}

func (f filterForm) values() url.Values {
	v := url.Values{}
	for k, s := range map[string]string{"kind": f.Kind, "queue": f.Queue, "class": f.Class, "since": f.Since, "until": f.Until} {
		if s != "" {
			v.Set(k, s)
		}
	}
	return v
}

func (f filterForm) Empty() bool { return f == filterForm{} }

// timeLayouts are what the filter accepts; the form's datetime-local
// fields send the first. Times are UTC.
var timeLayouts = []string{"2006-01-02T15:04", "2006-01-02T15:04:05", time.RFC3339, "2006-01-02 15:04", "2006-01-02"}

func parseTime(what, s string) (time.Time, error) {
	for _, l := range timeLayouts {
		if t, err := time.ParseInLocation(l, s, time.UTC); err == nil {
			return t, nil
		}
	}
	return time.Time{}, fmt.Errorf("%s %q: want a UTC time like 2026-01-31T14:05", what, s)
}

func readFilter(v url.Values) (filterForm, inspect.Filter, error) {
	v = maps.Clone(v)
	if err := tooLong(v, "kind", "queue", "class", "since", "until"); err != nil {
		return filterForm{}, inspect.Filter{}, err
	}
	f := filterForm{Kind: strings.TrimSpace(v.Get("kind")), Queue: strings.TrimSpace(v.Get("queue")),
		Class: strings.TrimSpace(v.Get("class")), Since: strings.TrimSpace(v.Get("since")), Until: strings.TrimSpace(v.Get("until"))}
	df := inspect.Filter{Kind: f.Kind, Queue: f.Queue, Class: f.Class}
	var err error
	if f.Class != "" && !slices.Contains(retry.StoredClasses(), retry.Class(f.Class)) {
		// As the CLI's --class: a typo would otherwise list nothing, silently.
		var names []string
		for _, c := range retry.StoredClasses() {
			names = append(names, string(c))
		}
		return f, df, fmt.Errorf("class %q: no such class; dead jobs carry %s", f.Class, strings.Join(names, ", "))
	}
	if f.Since != "" {
		if df.Since, err = parseTime("since", f.Since); err != nil {
			return f, df, err
		}
	}
	if f.Until != "" {
		if df.Until, err = parseTime("until", f.Until); err != nil {
			return f, df, err
		}
	}
	return f, df, nil
}

type deadRow struct {
	Job   idempotency.Job
	Steps []idempotency.StepRecord
}

type deadData struct {
	Filter        filterForm
	Total         int
	Rows          []deadRow
	Page, Pages   int
	PrevURL       string
	NextURL       string
	ReplayURL     string
	DiscardURL    string
	Classes       []string
	FirstN, LastN int
}

func (s *Server) deadLetters(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), pageTimeout)
	defer cancel()
	f, df, err := readFilter(r.URL.Query())
	d := deadData{Filter: f}
	for _, c := range retry.StoredClasses() {
		d.Classes = append(d.Classes, string(c))
	}
	if err != nil {
		s.render(w, r, http.StatusBadRequest, "dead", view{Title: "Dead letters", Nav: "dead", Error: err.Error(), Data: d})
		return
	}
	d.Page, _ = strconv.Atoi(r.URL.Query().Get("page"))
	d.Page = max(d.Page, 1)
	if d.Total, err = s.ops.Count(ctx, df); err != nil {
		s.ledgerError(w, r, err)
		return
	}
	size := s.cfg.PageSize
	d.Pages = max((d.Total+size-1)/size, 1)
	d.Page = min(d.Page, d.Pages)
	jobs, err := s.ops.List(ctx, df, size, (d.Page-1)*size)
	if err != nil {
		s.ledgerError(w, r, err)
		return
	}
	for _, j := range jobs {
		steps, err := s.store.Steps(ctx, j.ID)
		if err != nil {
			s.ledgerError(w, r, err)
			return
		}
		d.Rows = append(d.Rows, deadRow{Job: j, Steps: steps})
	}
	if len(jobs) > 0 {
		d.FirstN = (d.Page-1)*size + 1
		d.LastN = d.FirstN + len(jobs) - 1
	}
	pageURL := func(n int) string {
		v := f.values()
		v.Set("page", strconv.Itoa(n))
		return "/dead?" + v.Encode()
	}
	if d.Page > 1 {
		d.PrevURL = pageURL(d.Page - 1)
	}
	if d.Page < d.Pages {
		d.NextURL = pageURL(d.Page + 1)
	}
	v := f.values()
	v.Set("action", "replay")
	d.ReplayURL = "/dead/confirm?" + v.Encode()
	v.Set("action", "discard")
	d.DiscardURL = "/dead/confirm?" + v.Encode()
	s.render(w, r, http.StatusOK, "dead", view{Title: "Dead letters", Nav: "dead", Data: d})
}

type lookupData struct {
	Kind, Key, ID, Workflow string
}

// lookup finds a job by business key (kind + key) or by id, or a workflow
// by its id, and sends the browser to its page.
func (s *Server) lookup(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), pageTimeout)
	defer cancel()
	q := r.URL.Query()
	if err := tooLong(q, "kind", "key", "id", "workflow"); err != nil {
		s.render(w, r, http.StatusBadRequest, "lookup", view{Title: "Look up a job", Nav: "lookup", Error: err.Error(), Data: lookupData{}})
		return
	}
	// A business key may begin or end with spaces: it is looked up as
	// given, and trimmed only when no key is so (one pasted with stray
	// spaces).
	rawKey := q.Get("key")
	d := lookupData{Kind: strings.TrimSpace(q.Get("kind")), Key: strings.TrimSpace(rawKey), ID: strings.TrimSpace(q.Get("id")),
		Workflow: strings.TrimSpace(q.Get("workflow"))}
	if d.Workflow != "" {
		s.lookupWorkflow(w, r, d)
		return
	}
	var j idempotency.Job
	var err error
	switch {
	case d.ID != "":
		id := d.ID
		if u, perr := uuid.Parse(id); perr == nil {
			id = u.String() // upper case, braces…: as the ledger keeps it
		}
		j, err = s.store.Get(ctx, id)
	case d.Kind != "" && d.Key != "":
		j, err = s.store.Lookup(ctx, d.Kind, rawKey)
		if errors.Is(err, idempotency.ErrNotFound) && rawKey != d.Key {
			j, err = s.store.Lookup(ctx, d.Kind, d.Key)
		}
	case d.Key != "":
		s.render(w, r, http.StatusBadRequest, "lookup", view{Title: "Look up a job", Nav: "lookup",
			Error: "give both the kind and the business key", Data: d})
		return
	default:
		// No look-up asked for: the jobs list (kind alone filters it).
		s.jobsList(w, r)
		return
	}
	switch {
	case errors.Is(err, idempotency.ErrNotFound):
		d.Key = rawKey // the form shows the key as it was given
		msg := fmt.Sprintf("no job with kind %q and business key %q", d.Kind, d.Key)
		if d.ID != "" {
			msg = fmt.Sprintf("no job with id %q", d.ID)
		}
		s.render(w, r, http.StatusNotFound, "lookup", view{Title: "Look up a job", Nav: "lookup", Error: msg, Data: d})
	case err != nil:
		s.ledgerError(w, r, err)
	default:
		http.Redirect(w, r, "/jobs/"+url.PathEscape(j.ID), http.StatusSeeOther)
	}
}

type jobData struct {
	Job          idempotency.Job
	Steps        []idempotency.StepRecord
	Audit        []inspect.AuditEntry
	Payload      string
	Next         string
	LeaseExpired bool
	InDoubt      bool
	MonitorURL   string
	Note         string
	// PayloadHidden: the payload is of a kind this program does not
	// declare, whose redaction it cannot apply; PayloadShown: an operator
	// asked to see it anyway.
	PayloadHidden, PayloadShown bool
	// Deps: what the job waits for and what waits for it (job_deps.html).
	Deps *depsView
	// Ended: nothing will change the job without a person. Live: the page
	// reloads itself every Live seconds (?refresh=) while the job has not
	// ended, to follow its progress.
	Ended bool
	Live  int
	// Progress is what its handler last reported, nil if nothing;
	// Percent its share done (-1: no total). Result is a succeeded job's
	// result, laid out, "" if none.
	Progress *idempotency.JobProgress
	Percent  int64
	Result   string
}

// flashes are the only messages a redirect can ask a page to show: the
// page never echoes text from the URL.
var flashes = map[string]string{
	"replayed":          "Replayed: the job is pending again with a fresh retry budget; the relay hands it to a worker.",
	"already-replayed":  "Nothing to do: the job was no longer dead (someone replayed it first).",
	"not-dead":          "Nothing to do: the job is not dead, and only a dead job is replayed; its status is below.",
	"discarded":         "Discarded: the job is closed for good.",
	"already-discarded": "Nothing to do: the job was already closed (someone discarded it first); its resolution below is theirs.",
	"step-resolved":     "Step resolved. Replay the job when no step is left in doubt.",
	"cancelled":         "Cancelled: the job will not run.",
	"cancelled-running": "Cancelled: the job was running; its handler is being stopped, and nothing it does from now on can commit.",
	"already-cancelled": "Nothing to do: the job was already cancelled; its resolution below is the first cancel's.",
	"released":          "Released: the job no longer waits for its parents; it is pending, and the relay hands it to a worker.",
	"already-released":  "Nothing to do: the job was no longer waiting (its last parent succeeded, or someone released it first); its status is below.",
}

func (s *Server) job(w http.ResponseWriter, r *http.Request) {
	if canonicalRedirect(w, r, "/jobs/") {
		return
	}
	s.jobPage(w, r, r.PathValue("id"), http.StatusOK, flashes[r.URL.Query().Get("done")], "", "")
}

// canonicalRedirect sends a page asked for by an id in another UUID
// spelling (upper case, no hyphens, braces) to the id as the ledger keeps
// it, as the look-up and the CLI accept them.
func canonicalRedirect(w http.ResponseWriter, r *http.Request, prefix string) bool {
	id := r.PathValue("id")
	u, err := uuid.Parse(id)
	if err != nil || u.String() == id {
		return false
	}
	to := prefix + url.PathEscape(u.String())
	if r.URL.RawQuery != "" {
		to += "?" + r.URL.RawQuery
	}
	http.Redirect(w, r, to, http.StatusMovedPermanently)
	return true
}

func (s *Server) jobPage(w http.ResponseWriter, r *http.Request, id string, status int, flash, errMsg, note string) {
	s.jobPageShowing(w, r, id, status, flash, errMsg, note, false)
}

// showPayload shows an operator, on request, the payload of a kind whose
// redaction this program cannot apply; the request is audited.
func (s *Server) showPayload(w http.ResponseWriter, r *http.Request) {
	id, p := r.PathValue("id"), principalFrom(r.Context())
	if _, err := s.store.Get(r.Context(), id); err != nil {
		s.jobPage(w, r, id, http.StatusNotFound, "", "", "")
		return
	}
	s.audit(r.Context(), id, "show-payload", p.Name, "the payload of a kind this dashboard cannot redact")
	s.cfg.Logger.Info("keel web: payload shown", "job_id", id, "actor", p.Name)
	s.jobPageShowing(w, r, id, http.StatusOK, "", "", "", true)
}

// jobPageShowing is the job's page; showPayload shows a payload this
// program cannot redact (for an operator who asked).
func (s *Server) jobPageShowing(w http.ResponseWriter, r *http.Request, id string, status int, flash, errMsg, note string, showPayload bool) {
	ctx, cancel := context.WithTimeout(r.Context(), pageTimeout)
	defer cancel()
	j, err := s.store.Get(ctx, id)
	if errors.Is(err, idempotency.ErrNotFound) {
		s.errorPage(w, r, http.StatusNotFound, fmt.Sprintf("no job with id %q", id))
		return
	}
	if err != nil {
		s.ledgerError(w, r, err)
		return
	}
	d := jobData{Job: j, Note: note, MonitorURL: MonitoringPath + "/queues/" + url.PathEscape(j.Queue) + "/tasks/" + url.PathEscape(j.ID)}
	switch {
	case !s.hidesUndeclared || s.cfg.Kinds.Known(j.Kind):
		d.Payload = prettyPayload(s.cfg.PayloadFormatter(j.Kind, j.Payload))
	case showPayload && principalFrom(r.Context()).Operator():
		d.Payload, d.PayloadShown = prettyPayload(string(j.Payload)), true
	default:
		d.PayloadHidden = true
	}
	if d.Steps, err = s.store.Steps(ctx, j.ID); err == nil {
		d.Audit, err = s.ops.Audit(ctx, j.ID)
	}
	if err == nil {
		d.Deps, err = s.jobDeps(ctx, j)
	}
	if err == nil {
		err = s.readOutput(ctx, &d)
	}
	if err != nil {
		s.ledgerError(w, r, err)
		return
	}
	for _, st := range d.Steps {
		// A step its handler can Verify is settled by a replay.
		if st.Status == "started" && !st.Verifiable {
			d.InDoubt = true
		}
	}
	d.LeaseExpired = j.LeaseUntil != nil && time.Now().After(*j.LeaseUntil)
	relay := j.PublishedAt == nil
	if j.Status == idempotency.StatusPending && !relay {
		if relay, err = s.store.InOutbox(ctx, j.ID); err != nil {
			s.ledgerError(w, r, err)
			return
		}
	}
	var held pausedBy
	if j.Status == idempotency.StatusPaused {
		if held, err = s.pausesHolding(ctx, j); err != nil {
			s.ledgerError(w, r, err)
			return
		}
	}
	d.Next = nextStep(j, held, relay, d.InDoubt, d.LeaseExpired)
	s.markSeen(ctx, r, j)
	d.Ended = j.Status.Terminal() || j.Status == idempotency.StatusDead
	if n, err := strconv.Atoi(r.URL.Query().Get("refresh")); err == nil && slices.Contains(refreshChoices, n) && !d.Ended {
		d.Live = n
	}
	s.render(w, r, status, "job", view{Title: j.Kind + " " + j.BusinessKey, Nav: "jobs", Flash: flash, Error: errMsg, Data: d, Refresh: d.Live})
}

// readOutput reads what the job's handler reported and stored into d.
func (s *Server) readOutput(ctx context.Context, d *jobData) error {
	p, ok, err := s.ops.Progress(ctx, d.Job.ID)
	if err != nil {
		return err
	}
	if ok {
		d.Progress, d.Percent = &p, -1
		if p.Total > 0 {
			d.Percent = min(p.Done*100/p.Total, 100)
		}
	}
	if d.Job.Status != idempotency.StatusSucceeded {
		return nil
	}
	res, err := s.ops.Result(ctx, d.Job.ID)
	switch {
	case err == nil:
		d.Result = prettyPayload(string(res.JSON))
	case !errors.Is(err, idempotency.ErrNoResult):
		return err
	}
	return nil
}

// nextStep says, in a sentence, who handles the job next — the question
// asked of this page at 3 a.m. relay: a relay has still to publish it.
func nextStep(j idempotency.Job, held pausedBy, relay, inDoubt, leaseExpired bool) string {
	switch j.Status {
	case idempotency.StatusWaiting:
		if j.HeldForKey() {
			return "Held: waiting for a slot of its concurrency key " + visible.Text(j.ConcurrencyKey) + ", which has its limit of jobs in flight; " +
				"the oldest held job of the key is handed to a worker when one of them ends. An operator can release it to run it now, past the limit."
		}
		return fmt.Sprintf("Waiting for %d of the jobs below to succeed; the last one's success makes it pending, and the relay hands it to a worker. "+
			"An operator can release it to start it now.", j.WaitingOn)
	case idempotency.StatusPaused:
		var what string
		switch {
		case held.kind && held.queue:
			what = "its kind " + j.Kind + " and its queue " + j.Queue + " are paused (see Pauses). No worker starts it until both resume"
		case held.queue:
			what = "its queue " + j.Queue + " is paused (see Pauses), and Redis, which had lost the pause, delivered it. No worker starts it until the queue resumes"
		case held.kind:
			what = "its kind " + j.Kind + " is paused (see Pauses). No worker starts it until the kind resumes"
		default:
			what = "neither its kind " + j.Kind + " nor its queue " + j.Queue + " is paused any more, yet it is held (a pause removed by hand?). Resuming either releases it"
		}
		return "Held: " + what + "; then the relay hands it to a worker."
	case idempotency.StatusPending:
		if j.RunAt.After(time.Now()) {
			return "Runs at " + j.RunAt.UTC().Format("2006-01-02 15:04:05 UTC") + " (in " + time.Until(j.RunAt).Round(time.Second).String() +
				"); then any worker reading queue " + j.Queue + " runs it."
		}
		if relay {
			return "Waiting for the relay to hand it to Redis; then any worker reading queue " + j.Queue + " runs it."
		}
		return "In Redis, waiting for any worker reading queue " + j.Queue + "."
	case idempotency.StatusRunning:
		if leaseExpired {
			return "Its worker's lease has expired (the worker probably died); the next delivery of the job takes it over."
		}
		return "Running on " + j.LeaseHolder + ", which holds the lease; no other worker may run it until the lease ends."
	case idempotency.StatusFailed:
		if n, ok := j.DefaultPolicyRetries(); ok {
			return fmt.Sprintf("Failed attempt %d; asynq retries it with backoff on any worker. Its error is unclassified: "+
				"with the default retry policy it gets %d retries, not the kind's %d, so it dies after attempt %d unless a retry succeeds "+
				"or fails with a classified error.", j.Attempts, n, j.MaxRetry, n+1)
		}
		return fmt.Sprintf("Failed attempt %d of %d; asynq retries it with backoff on any worker.", j.Attempts, j.MaxRetry+1+j.ExtraRuns)
	case idempotency.StatusDead:
		switch {
		case j.SupersededAt != nil:
			return "Waiting for a person: a newer job of its key took its place, so it cannot be replayed; discard it with a note."
		case j.EffectsCommittedAt != nil:
			return "Waiting for a person: its local effects committed, so it cannot be replayed. Do what came after by hand, then discard it with a note."
		}
		if inDoubt {
			return "Waiting for a person: a step is in doubt. Say whether it happened, then replay or discard the job."
		}
		return "Waiting for a person: an operator can replay it (it runs again through the same handler) or discard it with a note."
	case idempotency.StatusSucceeded:
		return "Done. Further deliveries are acknowledged without running it."
	case idempotency.StatusDiscarded:
		return "Closed by " + j.ResolvedBy + "; nothing will run it again."
	case idempotency.StatusCancelled:
		return "Cancelled by " + j.ResolvedBy + "; nothing will run it again. Further deliveries are acknowledged without running it."
	}
	return ""
}

func (s *Server) replay(w http.ResponseWriter, r *http.Request) {
	id, p := r.PathValue("id"), principalFrom(r.Context())
	note := strings.TrimSpace(r.PostForm.Get("note"))
	res, err := s.ops.Replay(r.Context(), id, p.Name, note)
	if err != nil {
		s.actionFailed(w, r, id, "replay", err, note)
		return
	}
	s.cfg.Logger.Info("keel web: job replayed", "job_id", id, "actor", p.Name, "already", res.AlreadyReplayed)
	done := "replayed"
	if res.AlreadyReplayed {
		done = "not-dead"
		if s.wasReplayed(r.Context(), id) {
			done = "already-replayed"
		}
	}
	http.Redirect(w, r, "/jobs/"+url.PathEscape(id)+"?done="+done, http.StatusSeeOther)
}

// wasReplayed reports whether the audit log has a replay of job id: the
// reason a job someone meant to replay is no longer dead, when it is.
func (s *Server) wasReplayed(ctx context.Context, id string) bool {
	entries, err := s.ops.Audit(ctx, id)
	if err != nil {
		return false
	}
	return slices.ContainsFunc(entries, func(e inspect.AuditEntry) bool { return e.Action == "replay" })
}

func (s *Server) discard(w http.ResponseWriter, r *http.Request) {
	id, p := r.PathValue("id"), principalFrom(r.Context())
	note := strings.TrimSpace(r.PostForm.Get("note"))
	before, err := s.store.Get(r.Context(), id)
	// Already closed: said so, whatever the note (the form's own check
	// would otherwise ask for one to do nothing).
	if err == nil && before.Status == idempotency.StatusDiscarded {
		http.Redirect(w, r, "/jobs/"+url.PathEscape(id)+"?done=already-discarded", http.StatusSeeOther)
		return
	}
	res, err := s.ops.Discard(r.Context(), id, p.Name, note)
	if err != nil {
		s.actionFailed(w, r, id, "discard", err, note)
		return
	}
	done := "discarded"
	if res.AlreadyDiscarded {
		// Someone else closed it between the read and the discard.
		done = "already-discarded"
	}
	s.cfg.Logger.Info("keel web: job discarded", "job_id", id, "actor", p.Name, "already", done != "discarded")
	http.Redirect(w, r, "/jobs/"+url.PathEscape(id)+"?done="+done, http.StatusSeeOther)
}

func (s *Server) resolve(w http.ResponseWriter, r *http.Request) {
	id, p := r.PathValue("id"), principalFrom(r.Context())
	step, note := r.PostForm.Get("step"), strings.TrimSpace(r.PostForm.Get("note"))
	var happened bool
	switch r.PostForm.Get("happened") {
	case "yes":
		happened = true
	case "no":
	default:
		s.jobPage(w, r, id, http.StatusBadRequest, "", "say whether the step's call happened (yes or no)", note)
		return
	}
	j, err := s.store.Get(r.Context(), id)
	if err == nil && j.Status != idempotency.StatusDead {
		// A started step of a live job is a call in progress, not in doubt.
		err = fmt.Errorf("%w: steps are resolved only on dead jobs; this one is %s", inspect.ErrNotDead, j.Status)
	}
	if err == nil {
		err = s.ops.ResolveStep(r.Context(), id, step, happened, p.Name, note)
	}
	if err != nil {
		s.actionFailed(w, r, id, "resolve step", err, note)
		return
	}
	s.cfg.Logger.Info("keel web: step resolved", "job_id", id, "step", step, "happened", happened, "actor", p.Name)
	http.Redirect(w, r, "/jobs/"+url.PathEscape(id)+"?done=step-resolved", http.StatusSeeOther)
}

func (s *Server) actionFailed(w http.ResponseWriter, r *http.Request, id, action string, err error, note string) {
	status := http.StatusConflict
	switch {
	case errors.Is(err, idempotency.ErrNotFound):
		status = http.StatusNotFound
	case errors.Is(err, inspect.ErrNoteRequired):
		status = http.StatusBadRequest
	case errors.Is(err, inspect.ErrNotDead), errors.Is(err, inspect.ErrStepsInDoubt), errors.Is(err, inspect.ErrEffectsCommitted),
		errors.Is(err, inspect.ErrNotCancellable), errors.Is(err, inspect.ErrTaskActive), errors.Is(err, inspect.ErrNotWaiting),
		errors.Is(err, inspect.ErrCallInFlight):
	default:
		status = http.StatusInternalServerError
		s.cfg.Logger.Error("keel web: action failed", "action", action, "job_id", id, "err", err)
	}
	s.jobPage(w, r, id, status, "", action+" refused: "+err.Error(), note)
}

type confirmData struct {
	Action  string
	Verb    string   // Replay, Discard, Cancel
	State   string   // what the jobs acted on are: dead, or not finished
	IDs     []string // the jobs selected on the jobs list; none: the filter's
	Filter  filterForm
	Count   int
	Sample  []idempotency.Job
	Note    string
	Changed bool
	BackURL string
	// Refused is how many of them a replay refuses (steps in doubt, effects
	// committed, superseded): they stay dead.
	Refused int
	// Seen is when the page counted the jobs: a bulk action by filter acts
	// only on jobs that had died by then, so that a confirmed count is of
	// the jobs the person saw, not of others that died meanwhile.
	Seen string
}

func bulkAction(s string) (string, bool) {
	return s, s == "replay" || s == "discard" || s == "cancel"
}

// actsOn says, for a bulk action, which jobs it applies to: dead ones
// (replay, discard) or those not finished (cancel).
func actsOn(action string) (verb, state string, applies func(idempotency.Status) bool) {
	switch action {
	case "cancel":
		return "Cancel", "not finished", cancellable
	case "discard":
		return "Discard", "dead", func(st idempotency.Status) bool { return st == idempotency.StatusDead }
	}
	return "Replay", "dead", func(st idempotency.Status) bool { return st == idempotency.StatusDead }
}

// bulkConfirm shows how many dead letters a bulk action would touch; the
// count goes back with the form, and the action is refused if it changed.
func (s *Server) bulkConfirm(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	action, ok := bulkAction(q.Get("action"))
	if !ok {
		s.errorPage(w, r, http.StatusBadRequest, "action must be replay, discard or cancel")
		return
	}
	ids, err := selectedIDs(q)
	if err != nil {
		s.errorPage(w, r, http.StatusBadRequest, err.Error())
		return
	}
	if len(ids) > 0 {
		s.confirmSelected(w, r, http.StatusOK, action, ids, "", false, "")
		return
	}
	if action == "cancel" {
		s.errorPage(w, r, http.StatusBadRequest, "select the jobs to cancel on the jobs list")
		return
	}
	f, df, err := readFilter(q)
	if err != nil {
		s.errorPage(w, r, http.StatusBadRequest, err.Error())
		return
	}
	s.confirmPage(w, r, http.StatusOK, action, f, df, "", false, "")
}

// maxSelected bounds how many jobs one selection may name.
const maxSelected = 1000

func selectedIDs(v url.Values) ([]string, error) {
	var ids []string
	seen := map[string]bool{}
	for _, id := range v["id"] {
		if id = strings.TrimSpace(id); id != "" && !seen[id] {
			seen[id] = true
			ids = append(ids, id)
		}
	}
	if len(ids) > maxSelected {
		return nil, fmt.Errorf("at most %d jobs can be selected at once", maxSelected)
	}
	return ids, nil
}

// among returns those of ids the action applies to now.
func (s *Server) among(ctx context.Context, action string, ids []string) ([]idempotency.Job, error) {
	_, _, applies := actsOn(action)
	found, err := s.store.GetMany(ctx, s.store.Pool(), ids)
	if err != nil {
		return nil, err
	}
	byID := make(map[string]idempotency.Job, len(found))
	for _, j := range found {
		byID[j.ID] = j
	}
	var jobs []idempotency.Job
	for _, id := range ids {
		if j, ok := byID[id]; ok && applies(j.Status) {
			jobs = append(jobs, j)
		}
	}
	return jobs, nil
}

// confirmSelected is confirmPage for jobs picked one by one on the jobs
// list: it counts those still dead, and the action is refused if that
// count changed before it was confirmed.
func (s *Server) confirmSelected(w http.ResponseWriter, r *http.Request, status int, action string, ids []string, note string, changed bool, errMsg string) {
	ctx, cancel := context.WithTimeout(r.Context(), pageTimeout)
	defer cancel()
	jobs, err := s.among(ctx, action, ids)
	if err != nil {
		s.ledgerError(w, r, err)
		return
	}
	d := confirmData{Action: action, IDs: ids, Count: len(jobs), Note: note, Changed: changed, BackURL: selectedBackURL(action)}
	d.Verb, d.State, _ = actsOn(action)
	if action == "replay" {
		// As the filter's page: those a replay refuses stay dead.
		os, err := s.ops.Check(ctx, inspect.ActionReplay, jobIDs(jobs))
		if err != nil {
			s.ledgerError(w, r, err)
			return
		}
		for _, o := range os {
			if o.Err != nil && !errors.Is(o.Err, inspect.ErrNotFound) {
				d.Refused++
			}
		}
	}
	d.Sample = jobs[:min(len(jobs), 10)]
	s.render(w, r, status, "confirm", view{Title: "Confirm " + action, Nav: "jobs", Error: errMsg, Data: d})
}

// bulkSelected replays, discards or cancels the jobs the person selected
// (at most maxSelected) that the action applies to, in the request; ctx
// outlives the browser (see bulk).
func (s *Server) bulkSelected(ctx context.Context, w http.ResponseWriter, r *http.Request, action string, ids []string, expect int, note string) {
	p := principalFrom(r.Context())
	if action == "discard" && note == "" {
		s.confirmSelected(w, r, http.StatusBadRequest, action, ids, note, false, "a note saying why is required to discard")
		return
	}
	jobs, err := s.among(ctx, action, ids)
	if err != nil {
		s.ledgerError(w, r, err)
		return
	}
	if len(jobs) != expect {
		s.confirmSelected(w, r, http.StatusConflict, action, ids, note, true, "")
		return
	}
	res, err := s.ops.Bulk(ctx, inspect.Action(action), jobIDs(jobs), p.Name, note, nil)
	if err != nil && len(jobs) > 0 && res.Matched == 0 {
		s.ledgerError(w, r, err)
		return
	}
	s.cfg.Logger.Info("keel web: bulk action on selected jobs", "action", action, "actor", p.Name, "matched", res.Matched,
		"done", res.Done, "failed", len(res.Failed))
	s.render(w, r, http.StatusOK, "bulk", view{Title: "Bulk " + action, Nav: "jobs",
		Data: bulkData{Action: action, Result: res, BackURL: selectedBackURL(action)}})
}

func jobIDs(jobs []idempotency.Job) []string {
	ids := make([]string, len(jobs))
	for i, j := range jobs {
		ids[i] = j.ID
	}
	return ids
}

func selectedBackURL(action string) string {
	if action == "cancel" {
		return "/jobs"
	}
	return "/jobs?status=dead"
}

func (s *Server) confirmPage(w http.ResponseWriter, r *http.Request, status int, action string, f filterForm, df inspect.Filter, note string, changed bool, errMsg string) {
	ctx, cancel := context.WithTimeout(r.Context(), pageTimeout)
	defer cancel()
	d := confirmData{Action: action, Filter: f, Note: note, Changed: changed, BackURL: "/dead?" + f.values().Encode()}
	d.Verb, d.State, _ = actsOn(action)
	// The ledger's clock, which wrote the deaths' times, not this server's.
	var seen time.Time
	err := s.store.Pool().QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&seen)
	d.Seen = seen.UTC().Format(time.RFC3339Nano)
	if err == nil {
		d.Count, err = s.ops.Count(ctx, df)
	}
	if err == nil && action == "replay" && d.Count > 0 {
		var dry inspect.DryRun
		dry, err = s.ops.DryRunMatching(ctx, inspect.ActionReplay, df)
		d.Refused = dry.RefusedTotal()
	}
	if err == nil {
		d.Sample, err = s.ops.List(ctx, df, 10, 0)
	}
	if err != nil {
		s.ledgerError(w, r, err)
		return
	}
	s.render(w, r, status, "confirm", view{Title: "Confirm bulk " + action, Nav: "dead", Error: errMsg, Data: d})
}

type bulkData struct {
	Action  string
	Result  inspect.BulkResult
	BackURL string
	// Running: a background bulk action's progress page (see runBulk).
	Running bool
	Actor   string
}

func (s *Server) bulk(w http.ResponseWriter, r *http.Request) {
	p := principalFrom(r.Context())
	action, ok := bulkAction(r.PostForm.Get("action"))
	if !ok {
		s.errorPage(w, r, http.StatusBadRequest, "action must be replay, discard or cancel")
		return
	}
	expect, err := strconv.Atoi(r.PostForm.Get("expect"))
	if err != nil || expect < 0 {
		s.errorPage(w, r, http.StatusBadRequest, "the confirmed count is missing")
		return
	}
	if s.bulkStarting != nil {
		s.bulkStarting(r.Context())
	}
	// The person confirmed: a browser that leaves now must not stop the
	// selection, nor a selected action part-way.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), bulkSelectTimeout)
	defer cancel()
	note := strings.TrimSpace(r.PostForm.Get("note"))
	ids, err := selectedIDs(r.PostForm)
	if err != nil {
		s.errorPage(w, r, http.StatusBadRequest, err.Error())
		return
	}
	if len(ids) > 0 {
		s.bulkSelected(ctx, w, r, action, ids, expect, note)
		return
	}
	if action == "cancel" {
		s.errorPage(w, r, http.StatusBadRequest, "select the jobs to cancel on the jobs list")
		return
	}
	f, df, err := readFilter(r.PostForm)
	if err != nil {
		s.errorPage(w, r, http.StatusBadRequest, err.Error())
		return
	}
	shown := df
	if seen := r.PostForm.Get("seen"); seen != "" {
		at, err := time.Parse(time.RFC3339Nano, seen)
		if err != nil {
			s.errorPage(w, r, http.StatusBadRequest, "seen: not a time")
			return
		}
		if shown.Until.IsZero() || at.Before(shown.Until) {
			shown.Until = at
		}
	}
	if action == "discard" && note == "" {
		s.confirmPage(w, r, http.StatusBadRequest, action, f, df, note, false, "a note saying why is required to discard")
		return
	}
	// Selected now and checked against the count the person confirmed, so
	// that a confirmation always means what it said; acted on in the
	// background (see runBulk).
	ids, err = s.ops.IDs(ctx, shown)
	if err != nil {
		s.ledgerError(w, r, err)
		return
	}
	if len(ids) != expect {
		s.confirmPage(w, r, http.StatusConflict, action, f, df, note, true, "")
		return
	}
	s.runBulk(w, r, inspect.Action(action), "dead", ids, "/dead?"+f.values().Encode(), note, func(res inspect.BulkResult) {
		s.cfg.Logger.Info("keel web: bulk action", "action", action, "actor", p.Name, "matched", res.Matched,
			"done", res.Done, "failed", len(res.Failed), "filter", f.values().Encode())
	})
}
