package alert

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/testsignal"
)

// Defaults of Config.
const (
	DefaultWindow       = 30 * time.Second
	DefaultMaxAttempts  = 5
	DefaultRetryBackoff = time.Second
	DefaultHTTPTimeout  = 10 * time.Second
	DefaultFlushTimeout = 5 * time.Second
)

// Limits of one webhook body.
const (
	// MaxExamples is how many deaths a summary shows in full: the first ones
	// of the window.
	MaxExamples = 5
	// MaxGroups bounds how many kinds (and classes) a summary counts one by
	// one; deaths of further ones are counted under OtherGroup. It keeps the
	// memory of a window bounded whatever dies in it.
	MaxGroups = 100
	// OtherGroup is the by_kind and by_class key of deaths past MaxGroups.
	OtherGroup = "(other)"
	// MaxErrorBytes bounds the error text of one death in a webhook body.
	MaxErrorBytes = 1024
)

// Webhook body types, in the "type" field.
const (
	TypeDeath   = "keel.job.dead"
	TypeSummary = "keel.jobs.dead"
)

// MetricName is the counter JobDied increments, labelled kind, queue and
// class. metrics.Worker's OnDead counts the same series: when a worker uses
// both, give the Alerter a Registerer of its own so that each death is
// counted once.
const MetricName = "keel_jobs_dead_total"

// ErrRunning is returned by Run when the Alerter is already running.
var ErrRunning = errors.New("alert: Run is already running")

// Config configures an Alerter.
type Config struct {
	// WebhookURL receives a JSON POST for the deaths of each window (http or
	// https). Empty: no webhook; deaths are still logged and counted.
	WebhookURL string
	// Window: the deaths that follow the first one within Window are sent
	// as one call, so a burst of deaths is one alert, not hundreds. Default
	// DefaultWindow (30s).
	Window time.Duration
	// MaxAttempts bounds the tries of one webhook call. Network errors, 5xx,
	// 408 and 429 are tried again; any other status is final. Default
	// DefaultMaxAttempts (5).
	MaxAttempts int
	// RetryBackoff is the wait before the second try; it doubles before each
	// further one (1s, 2s, 4s, 8s by default), so with HTTPClient's timeout
	// one call takes at most MaxAttempts×timeout + 15s. Default
	// DefaultRetryBackoff (1s).
	RetryBackoff time.Duration
	// HTTPClient sends the webhook. Default: a client of its own with a
	// DefaultHTTPTimeout (10s) timeout.
	HTTPClient *http.Client
	// FlushTimeout bounds the final flush when Run's context ends. Default
	// DefaultFlushTimeout (5s).
	FlushTimeout time.Duration
	// Logger receives one Error line per death and the webhook's failures.
	// Default slog.Default().
	Logger *slog.Logger
	// Registerer gets the MetricName counter. Default
	// prometheus.DefaultRegisterer. A counter of that name already
	// registered with the same labels is shared, not an error.
	Registerer prometheus.Registerer
}

// WithDefaults returns c with every unset field at its default.
func (c Config) WithDefaults() Config {
	if c.Window == 0 {
		c.Window = DefaultWindow
	}
	if c.MaxAttempts == 0 {
		c.MaxAttempts = DefaultMaxAttempts
	}
	if c.RetryBackoff == 0 {
		c.RetryBackoff = DefaultRetryBackoff
	}
	if c.HTTPClient == nil {
		// A transport of its own, so that closing its idle connections when
		// Run ends touches nobody else's.
		var rt http.RoundTripper = http.DefaultTransport
		if t, ok := rt.(*http.Transport); ok {
			rt = t.Clone()
		}
		c.HTTPClient = &http.Client{Timeout: DefaultHTTPTimeout, Transport: rt}
	}
	if c.FlushTimeout == 0 {
		c.FlushTimeout = DefaultFlushTimeout
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.Registerer == nil {
		c.Registerer = prometheus.DefaultRegisterer
	}
	return c
}

// Validate reports every setting of c that cannot work.
func (c Config) Validate() error {
	var errs []error
	if c.WebhookURL != "" {
		u, err := url.Parse(c.WebhookURL)
		switch {
		case err != nil:
			errs = append(errs, fmt.Errorf("alert: WebhookURL does not parse: %w", withoutURL(err)))
		case u.Scheme == "":
			errs = append(errs, errors.New("alert: WebhookURL has no scheme: want an http:// or https:// URL"))
		case u.Scheme != "http" && u.Scheme != "https":
			errs = append(errs, fmt.Errorf("alert: WebhookURL %q: scheme must be http or https", redact(u)))
		case u.Host == "":
			errs = append(errs, fmt.Errorf("alert: WebhookURL %q has no host", redact(u)))
		}
	}
	for _, f := range []struct {
		name string
		d    time.Duration
	}{{"Window", c.Window}, {"RetryBackoff", c.RetryBackoff}, {"FlushTimeout", c.FlushTimeout}} {
		if f.d < 0 {
			errs = append(errs, fmt.Errorf("alert: %s must not be negative, got %v", f.name, f.d))
		}
	}
	if c.MaxAttempts < 0 {
		errs = append(errs, fmt.Errorf("alert: MaxAttempts must not be negative, got %d", c.MaxAttempts))
	}
	return errors.Join(errs...)
}

// redact shows a webhook URL in errors and logs as its scheme and host
// only: webhook URLs carry their secret in the path, query or user info.
func redact(u *url.URL) string {
	s := u.Scheme + "://" + u.Host
	if u.Path != "" || u.RawQuery != "" || u.User != nil {
		s += "/…"
	}
	return s
}

// withoutURL drops the URL that net/url and net/http put into their
// errors, for the same reason.
func withoutURL(err error) error {
	var uerr *url.Error
	if errors.As(err, &uerr) {
		return uerr.Err
	}
	return err
}

// Alerter reports dead jobs: a log line and a metric at once, and a webhook
// call per window. Wire JobDied as server.GuardConfig.OnDead and run
// Run for the webhook.
type Alerter struct {
	cfg  Config
	dead *prometheus.CounterVec
	hook string // redacted WebhookURL, for logs

	mu      sync.Mutex
	pending batch // deaths not yet sent
	wake    chan struct{}
	running atomic.Bool

	signals testSignals
}

// testSignals tell tests what the Alerter did, so they wait on it rather
// than on the clock; off in production (see export_test.go).
type testSignals struct {
	// Flushed is each window's end, once its webhook call is over.
	Flushed testsignal.Signal[flushed]
	// Retrying is each failed webhook try that will be tried again.
	Retrying testsignal.Signal[error]
}

// flushed is how a window's webhook call ended, as testSignals report it.
type flushed struct {
	Deaths int
	// Err is why the deaths were not delivered; nil when they were.
	Err error
	// Kept says the deaths were put back for the final flush (Run's
	// context ended during the call).
	Kept bool
}

// New returns an Alerter, its counter registered on cfg.Registerer.
func New(cfg Config) (*Alerter, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	dead := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: MetricName,
		Help: "Jobs moved to the dead letters, by error class.",
	}, []string{"kind", "queue", "class"})
	if err := cfg.Registerer.Register(dead); err != nil {
		var are prometheus.AlreadyRegisteredError
		if !errors.As(err, &are) {
			return nil, fmt.Errorf("alert: register %s: %w", MetricName, err)
		}
		existing, ok := are.ExistingCollector.(*prometheus.CounterVec)
		if !ok {
			return nil, fmt.Errorf("alert: %s is registered already, and not as a counter", MetricName)
		}
		dead = existing
	}
	a := &Alerter{cfg: cfg, dead: dead, wake: make(chan struct{}, 1)}
	if cfg.WebhookURL != "" {
		u, _ := url.Parse(cfg.WebhookURL)
		a.hook = redact(u)
	}
	return a, nil
}

// JobDied reports one death: it logs it, counts it and queues it for the
// webhook. It never waits for the webhook, so it is safe to call from the
// worker's hot path: it has the shape of server.GuardConfig.OnDead.
func (a *Alerter) JobDied(ctx context.Context, e idempotency.DeadEvent) {
	e.LogDied(ctx, a.cfg.Logger)
	a.dead.WithLabelValues(e.Kind, e.Queue, e.Class).Inc()
	if a.cfg.WebhookURL == "" {
		return
	}
	ev := Event{JobID: e.JobID, Kind: e.Kind, Queue: e.Queue, BusinessKey: e.BusinessKey, Class: e.Class,
		Attempts: e.Attempts, Error: truncate(e.Error, MaxErrorBytes), At: time.Now().UTC()}
	a.mu.Lock()
	first := a.pending.count == 0
	a.pending.add(ev)
	a.mu.Unlock()
	if first {
		select {
		case a.wake <- struct{}{}:
		default:
		}
	}
}

// Run sends the webhook until ctx ends: a window after the first death it
// sends every death of that window in one call. When ctx ends it sends what
// is left, within FlushTimeout, and returns nil. One Run at a time: a
// second one returns ErrRunning.
func (a *Alerter) Run(ctx context.Context) error {
	if !a.running.CompareAndSwap(false, true) {
		return ErrRunning
	}
	defer a.running.Store(false)
	defer a.cfg.HTTPClient.CloseIdleConnections()
	for {
		select {
		case <-ctx.Done():
			a.finalFlush(ctx)
			return nil
		case <-a.wake:
		}
		if ctx.Err() != nil { // a wake-up and the end can come together
			a.finalFlush(ctx)
			return nil
		}
		a.mu.Lock()
		first, count := a.pending.first, a.pending.count
		a.mu.Unlock()
		if count == 0 {
			continue
		}
		// Deaths that arrived before Run started have waited already.
		t := time.NewTimer(time.Until(first.Add(a.cfg.Window)))
		select {
		case <-ctx.Done():
			t.Stop()
			a.finalFlush(ctx)
			return nil
		case <-t.C:
		}
		a.flush(ctx, false)
	}
}

func (a *Alerter) finalFlush(ctx context.Context) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), a.cfg.FlushTimeout)
	defer cancel()
	a.flush(ctx, true)
}

// flush sends the pending deaths. When Run's context ends during the call
// they are put back, for the final flush to send.
func (a *Alerter) flush(ctx context.Context, final bool) {
	a.mu.Lock()
	b := a.pending
	a.pending = batch{}
	a.mu.Unlock()
	if b.count == 0 {
		return
	}
	body, err := json.Marshal(b.body(a.cfg.Window))
	if err != nil { // cannot happen: the body is strings and numbers
		a.cfg.Logger.Error("keel: death alert does not encode", "deaths", b.count, "err", err)
		return
	}
	err = a.send(ctx, body)
	switch {
	case err == nil:
		a.signals.Flushed.Signal(flushed{Deaths: b.count})
	case !final && ctx.Err() != nil && !isFinal(err):
		n := b.count
		a.mu.Lock()
		b.absorb(a.pending)
		a.pending = b
		a.mu.Unlock()
		a.signals.Flushed.Signal(flushed{Deaths: n, Err: err, Kept: true})
	default:
		a.cfg.Logger.Error("keel: death alert not delivered", "webhook", a.hook, "deaths", b.count, "err", err)
		a.signals.Flushed.Signal(flushed{Deaths: b.count, Err: err})
	}
}

// finalError is a webhook answer that trying again cannot change.
type finalError struct{ err error }

func (e finalError) Error() string { return e.err.Error() }
func (e finalError) Unwrap() error { return e.err }

func isFinal(err error) bool {
	var f finalError
	return errors.As(err, &f)
}

// send POSTs body, trying again with exponential backoff after network
// errors, 5xx, 408 and 429, at most MaxAttempts times in all.
func (a *Alerter) send(ctx context.Context, body []byte) error {
	wait := a.cfg.RetryBackoff
	for try := 1; ; try++ {
		err := a.post(ctx, body)
		if err == nil {
			return nil
		}
		if isFinal(err) || try >= a.cfg.MaxAttempts || ctx.Err() != nil {
			return fmt.Errorf("try %d of %d: %w", try, a.cfg.MaxAttempts, err)
		}
		a.cfg.Logger.Warn("keel: death alert webhook failed, trying again", "webhook", a.hook, "try", try, "in", wait, "err", err)
		a.signals.Retrying.Signal(err)
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return fmt.Errorf("try %d of %d: %w", try, a.cfg.MaxAttempts, ctx.Err())
		case <-t.C:
		}
		wait *= 2
	}
}

func (a *Alerter) post(ctx context.Context, body []byte) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, a.cfg.WebhookURL, bytes.NewReader(body))
	if err != nil {
		return finalError{withoutURL(err)}
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("User-Agent", "keel-alert")
	resp, err := a.cfg.HTTPClient.Do(req)
	if err != nil {
		return withoutURL(err)
	}
	defer resp.Body.Close()
	snippet, _ := io.ReadAll(io.LimitReader(resp.Body, 256))
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10)) // lets the connection be reused
	if resp.StatusCode >= 200 && resp.StatusCode < 300 {
		return nil
	}
	err = fmt.Errorf("webhook answered %s: %s", resp.Status, strings.TrimSpace(string(snippet)))
	switch {
	case resp.StatusCode >= 500, resp.StatusCode == http.StatusRequestTimeout, resp.StatusCode == http.StatusTooManyRequests:
		return err
	}
	return finalError{err}
}

// Event is one death as the webhook shows it.
type Event struct {
	JobID       string    `json:"job_id"`
	Kind        string    `json:"kind"`
	Queue       string    `json:"queue"`
	BusinessKey string    `json:"business_key,omitempty"`
	Class       string    `json:"class"`
	Attempts    int       `json:"attempts"`
	Error       string    `json:"error"`
	At          time.Time `json:"at"`
}

// Death is the webhook body of a window with one death.
type Death struct {
	Type string `json:"type"` // TypeDeath
	// Text is a one-line description, which chat webhooks (Slack,
	// Mattermost) show as the message.
	Text string `json:"text"`
	Event
}

// Summary is the webhook body of a window with several deaths.
type Summary struct {
	Type     string         `json:"type"` // TypeSummary
	Text     string         `json:"text"`
	Count    int            `json:"count"`
	ByKind   map[string]int `json:"by_kind"`
	ByClass  map[string]int `json:"by_class"`
	Examples []Event        `json:"examples"` // the first MaxExamples deaths
	Window   string         `json:"window"`
}

// batch is the deaths of one window, in bounded memory.
type batch struct {
	count           int
	first           time.Time
	byKind, byClass map[string]int
	examples        []Event
}

func (b *batch) add(e Event) {
	if b.count == 0 {
		b.first = e.At
	}
	b.count++
	b.byKind = inc(b.byKind, e.Kind, 1)
	b.byClass = inc(b.byClass, e.Class, 1)
	if len(b.examples) < MaxExamples {
		b.examples = append(b.examples, e)
	}
}

// absorb adds the later batch o to b.
func (b *batch) absorb(o batch) {
	if o.count == 0 {
		return
	}
	if b.count == 0 {
		b.first = o.first
	}
	b.count += o.count
	for k, n := range o.byKind {
		b.byKind = inc(b.byKind, k, n)
	}
	for k, n := range o.byClass {
		b.byClass = inc(b.byClass, k, n)
	}
	for _, e := range o.examples {
		if len(b.examples) < MaxExamples {
			b.examples = append(b.examples, e)
		}
	}
}

func inc(m map[string]int, k string, n int) map[string]int {
	if m == nil {
		m = map[string]int{}
	}
	if _, ok := m[k]; !ok && len(m) >= MaxGroups {
		k = OtherGroup
	}
	m[k] += n
	return m
}

func (b *batch) body(window time.Duration) any {
	if b.count == 1 {
		e := b.examples[0]
		name := e.Kind
		if e.BusinessKey != "" {
			name += " " + e.BusinessKey
		}
		return Death{Type: TypeDeath, Event: e, Text: fmt.Sprintf("keel: job %s died after %d attempts (%s, job %s): %s",
			name, e.Attempts, e.Class, e.JobID, truncate(e.Error, 200))}
	}
	return Summary{
		Type:     TypeSummary,
		Text:     fmt.Sprintf("keel: %d jobs died within %s (%s)", b.count, window, top(b.byKind, 5)),
		Count:    b.count,
		ByKind:   b.byKind,
		ByClass:  b.byClass,
		Examples: b.examples,
		Window:   window.String(),
	}
}

// top names the n largest groups of m, largest first: "a 40, b 9, …".
func top(m map[string]int, n int) string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Slice(keys, func(i, j int) bool {
		if m[keys[i]] != m[keys[j]] {
			return m[keys[i]] > m[keys[j]]
		}
		return keys[i] < keys[j]
	})
	parts := make([]string, 0, n+1)
	for i, k := range keys {
		if i == n {
			parts = append(parts, "…")
			break
		}
		parts = append(parts, fmt.Sprintf("%s %d", k, m[k]))
	}
	return strings.Join(parts, ", ")
}

// truncate cuts s to at most n bytes, and an ellipsis, without splitting a
// character.
func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	cut := n
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + "…"
}
