package alert_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/keeljobs/keel/alert"
	"github.com/keeljobs/keel/idempotency"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// webhook is a test endpoint that records every call and answers with the
// status respond returns for it (1-based).
type webhook struct {
	srv     *httptest.Server
	calls   chan []byte
	respond func(call int) int

	mu sync.Mutex
	n  int
}

func newWebhook(t *testing.T, respond func(call int) int) *webhook {
	t.Helper()
	w := &webhook{calls: make(chan []byte, 100), respond: respond}
	w.srv = httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(r.Body)
		if err != nil || r.Method != http.MethodPost || r.Header.Get("Content-Type") != "application/json" {
			http.Error(rw, "bad request", http.StatusBadRequest)
			return
		}
		w.mu.Lock()
		w.n++
		n := w.n
		w.mu.Unlock()
		w.calls <- body
		status := http.StatusOK
		if w.respond != nil {
			status = w.respond(n)
		}
		rw.WriteHeader(status)
	}))
	t.Cleanup(w.srv.Close)
	return w
}

func (w *webhook) count() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.n
}

// next returns the body of the next call.
func (w *webhook) next(t *testing.T) []byte {
	t.Helper()
	select {
	case b := <-w.calls:
		return b
	case <-time.After(5 * time.Second):
		t.Fatal("the webhook was not called")
		return nil
	}
}

// quiet fails if the webhook was called and the call not read. Call it
// after a Flushed signal: every call of that window has reached the
// webhook by then, and no other is under way.
func (w *webhook) quiet(t *testing.T) {
	t.Helper()
	select {
	case b := <-w.calls:
		t.Fatalf("unexpected webhook call: %s", b)
	default:
	}
}

// logBuffer collects log output from several goroutines.
type logBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (l *logBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.Write(p)
}

// records returns the JSON log records with message msg.
func (l *logBuffer) records(t *testing.T, msg string) []map[string]any {
	t.Helper()
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []map[string]any
	for _, line := range strings.Split(strings.TrimSpace(l.buf.String()), "\n") {
		if line == "" {
			continue
		}
		var r map[string]any
		require.NoError(t, json.Unmarshal([]byte(line), &r), line)
		if r["msg"] == msg {
			out = append(out, r)
		}
	}
	return out
}

type fixture struct {
	alerter *alert.Alerter
	signals *alert.TestSignals
	reg     *prometheus.Registry
	logs    *logBuffer
}

// newAlerter returns an Alerter on a fresh registry with fast timings,
// posting to url; mod adjusts the config.
func newAlerter(t *testing.T, url string, mod func(*alert.Config)) fixture {
	t.Helper()
	f := fixture{reg: prometheus.NewRegistry(), logs: &logBuffer{}}
	cfg := alert.Config{
		WebhookURL:   url,
		Window:       100 * time.Millisecond,
		RetryBackoff: 10 * time.Millisecond,
		FlushTimeout: time.Second,
		Logger:       slog.New(slog.NewJSONHandler(f.logs, nil)),
		Registerer:   f.reg,
	}
	if mod != nil {
		mod(&cfg)
	}
	a, err := alert.New(cfg)
	require.NoError(t, err)
	f.alerter = a
	f.signals = alert.InitTestSignals(a)
	return f
}

// flushed waits for the end of the next window's webhook call.
func (f fixture) flushed(t *testing.T) alert.Flushed {
	t.Helper()
	return f.signals.Flushed.Wait(t)
}

// run runs the alerter until the test ends or the returned stop is called.
func (f fixture) run(t *testing.T) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- f.alerter.Run(ctx) }()
	stop = sync.OnceFunc(func() {
		cancel()
		select {
		case err := <-done:
			require.NoError(t, err)
		case <-time.After(10 * time.Second):
			t.Error("Run did not return after its context ended")
		}
	})
	t.Cleanup(stop)
	return stop
}

func death(i int, kind, class string) idempotency.DeadEvent {
	return idempotency.DeadEvent{
		JobID: fmt.Sprintf("job-%02d", i), Kind: kind, Queue: "default", BusinessKey: fmt.Sprintf("order:%d", i),
		Class: class, Error: fmt.Sprintf("failure %d", i), Attempts: 3,
	}
}

func TestBurstIsOneSummary(t *testing.T) {
	t.Parallel()
	hook := newWebhook(t, nil)
	f := newAlerter(t, hook.srv.URL, func(c *alert.Config) { c.Window = 300 * time.Millisecond })
	f.run(t)
	ctx := context.Background()
	for i := range 50 {
		switch {
		case i < 40:
			f.alerter.JobDied(ctx, death(i, "order:send_receipt", "transient"))
		case i < 48:
			f.alerter.JobDied(ctx, death(i, "order:charge", "permanent"))
		default:
			f.alerter.JobDied(ctx, death(i, "order:charge", "unknown"))
		}
	}

	require.Equal(t, alert.Flushed{Deaths: 50}, f.flushed(t), "a burst must be one window")
	var s alert.Summary
	require.NoError(t, json.Unmarshal(hook.next(t), &s))
	hook.quiet(t)
	require.Equal(t, 1, hook.count(), "a burst must be one webhook call")
	require.Equal(t, alert.TypeSummary, s.Type)
	require.Equal(t, 50, s.Count)
	require.Equal(t, map[string]int{"order:send_receipt": 40, "order:charge": 10}, s.ByKind)
	require.Equal(t, map[string]int{"transient": 40, "permanent": 8, "unknown": 2}, s.ByClass)
	require.Equal(t, "300ms", s.Window)
	require.Len(t, s.Examples, alert.MaxExamples)
	for i, e := range s.Examples {
		require.Equal(t, fmt.Sprintf("job-%02d", i), e.JobID, "examples are the first deaths, in order")
	}
	require.Equal(t, "order:1", s.Examples[1].BusinessKey)
	require.Contains(t, s.Text, "50 jobs died")

	require.NoError(t, testutil.GatherAndCompare(f.reg, strings.NewReader(`
# HELP keel_jobs_dead_total Jobs moved to the dead letters, by error class.
# TYPE keel_jobs_dead_total counter
keel_jobs_dead_total{class="permanent",kind="order:charge",queue="default"} 8
keel_jobs_dead_total{class="transient",kind="order:send_receipt",queue="default"} 40
keel_jobs_dead_total{class="unknown",kind="order:charge",queue="default"} 2
`), alert.MetricName))

	logged := f.logs.records(t, "keel: job died")
	require.Len(t, logged, 50, "one log line per death")
	require.Equal(t, "ERROR", logged[7]["level"])
	for k, v := range map[string]any{"job_id": "job-07", "kind": "order:send_receipt", "queue": "default",
		"business_key": "order:7", "class": "transient", "attempts": 3.0, "err": "failure 7"} {
		require.Equal(t, v, logged[7][k], k)
	}
}

func TestSingleDeathIsOneEvent(t *testing.T) {
	t.Parallel()
	hook := newWebhook(t, nil)
	f := newAlerter(t, hook.srv.URL, nil)
	f.run(t)
	f.alerter.JobDied(context.Background(), idempotency.DeadEvent{
		JobID: "0192f3", Kind: "order:send_receipt", Queue: "critical", BusinessKey: "order:42",
		Class: "permanent", Error: "keel: order:send_receipt payload does not decode", Attempts: 1,
	})

	body := hook.next(t)
	var d alert.Death
	require.NoError(t, json.Unmarshal(body, &d))
	require.Equal(t, alert.TypeDeath, d.Type)
	require.Equal(t, "0192f3", d.JobID)
	require.Equal(t, "order:send_receipt", d.Kind)
	require.Equal(t, "critical", d.Queue)
	require.Equal(t, "order:42", d.BusinessKey)
	require.Equal(t, "permanent", d.Class)
	require.Equal(t, 1, d.Attempts)
	require.Equal(t, "keel: order:send_receipt payload does not decode", d.Error)
	require.WithinDuration(t, time.Now(), d.At, 5*time.Second)
	require.Contains(t, d.Text, "order:42")
	var raw map[string]any
	require.NoError(t, json.Unmarshal(body, &raw))
	require.NotContains(t, raw, "count", "one death is an event, not a summary")
	require.Equal(t, alert.Flushed{Deaths: 1}, f.flushed(t))
	hook.quiet(t)
}

func TestWebhookServerErrorsAreRetried(t *testing.T) {
	t.Parallel()
	hook := newWebhook(t, func(call int) int {
		if call <= 2 {
			return http.StatusInternalServerError
		}
		return http.StatusOK
	})
	f := newAlerter(t, hook.srv.URL, nil)
	f.run(t)
	f.alerter.JobDied(context.Background(), death(1, "order:charge", "transient"))

	first := hook.next(t)
	require.Equal(t, first, hook.next(t), "a retry must send the same body")
	require.Equal(t, first, hook.next(t))
	require.Equal(t, alert.Flushed{Deaths: 1}, f.flushed(t))
	hook.quiet(t)
	require.Equal(t, 3, hook.count(), "delivered once, after three tries")
	require.Len(t, f.logs.records(t, "keel: death alert webhook failed, trying again"), 2)
	require.Empty(t, f.logs.records(t, "keel: death alert not delivered"))
}

func TestWebhookClientErrorIsNotRetried(t *testing.T) {
	t.Parallel()
	hook := newWebhook(t, func(int) int { return http.StatusBadRequest })
	f := newAlerter(t, hook.srv.URL+"/hooks/s3cret", nil)
	f.run(t)
	f.alerter.JobDied(context.Background(), death(1, "order:charge", "permanent"))

	hook.next(t)
	require.ErrorContains(t, f.flushed(t).Err, "400")
	hook.quiet(t)
	require.Equal(t, 1, hook.count())
	require.Len(t, f.logs.records(t, "keel: death alert not delivered"), 1)
	failed := f.logs.records(t, "keel: death alert not delivered")[0]
	require.Equal(t, 1.0, failed["deaths"])
	require.Contains(t, failed["err"], "400")
	require.Equal(t, hook.srv.URL+"/…", failed["webhook"])
	f.logs.mu.Lock()
	defer f.logs.mu.Unlock()
	require.NotContains(t, f.logs.buf.String(), "s3cret", "the webhook's secret reached the log")
}

func TestWebhookRetriesAreBounded(t *testing.T) {
	t.Parallel()
	hook := newWebhook(t, func(int) int { return http.StatusServiceUnavailable })
	f := newAlerter(t, hook.srv.URL, func(c *alert.Config) { c.MaxAttempts = 3 })
	f.run(t)
	f.alerter.JobDied(context.Background(), death(1, "order:charge", "transient"))

	for range 3 {
		hook.next(t)
	}
	require.ErrorContains(t, f.flushed(t).Err, "try 3 of 3")
	hook.quiet(t)
	require.Len(t, f.logs.records(t, "keel: death alert not delivered"), 1)

	// The alerter is still alive for the next window.
	f.alerter.JobDied(context.Background(), death(2, "order:charge", "transient"))
	var d alert.Death
	require.NoError(t, json.Unmarshal(hook.next(t), &d))
	require.Equal(t, "job-02", d.JobID)
}

func TestWebhookNetworkErrorIsRetried(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	calls := 0
	got := make(chan []byte, 10)
	srv := httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		mu.Lock()
		calls++
		n := calls
		mu.Unlock()
		if n == 1 {
			// Drop the connection without an answer.
			if conn, _, err := rw.(http.Hijacker).Hijack(); err == nil {
				conn.Close()
			}
			return
		}
		body, _ := io.ReadAll(r.Body)
		got <- body
	}))
	defer srv.Close()
	f := newAlerter(t, srv.URL, nil)
	f.run(t)
	f.alerter.JobDied(context.Background(), death(1, "order:charge", "transient"))

	select {
	case body := <-got:
		require.Contains(t, string(body), "job-01")
	case <-time.After(5 * time.Second):
		t.Fatal("the alert was not delivered after a network error")
	}
	// The window's call is over: no try is left to come.
	require.Equal(t, alert.Flushed{Deaths: 1}, f.flushed(t))
	mu.Lock()
	defer mu.Unlock()
	require.Equal(t, 2, calls)
	require.Len(t, f.logs.records(t, "keel: death alert webhook failed, trying again"), 1)
}

func TestShutdownFlushesPendingDeaths(t *testing.T) {
	t.Parallel()
	hook := newWebhook(t, nil)
	f := newAlerter(t, hook.srv.URL, func(c *alert.Config) { c.Window = time.Hour })
	stop := f.run(t)
	f.alerter.JobDied(context.Background(), death(1, "order:charge", "transient"))
	f.alerter.JobDied(context.Background(), death(2, "order:charge", "transient"))

	stop()
	require.Equal(t, 1, hook.count(), "Run returned before the final flush")
	var s alert.Summary
	require.NoError(t, json.Unmarshal(hook.next(t), &s))
	require.Equal(t, 2, s.Count)
	require.Equal(t, "1h0m0s", s.Window)
}

func TestShutdownFlushIsBounded(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		select { // a webhook that hangs
		case <-release:
		case <-r.Context().Done():
		}
	}))
	defer srv.Close()
	defer close(release)
	f := newAlerter(t, srv.URL, func(c *alert.Config) {
		c.Window = time.Hour
		c.FlushTimeout = 200 * time.Millisecond
	})
	stop := f.run(t)
	f.alerter.JobDied(context.Background(), death(1, "order:charge", "transient"))

	start := time.Now()
	stop()
	require.Less(t, time.Since(start), 2*time.Second)
	require.ErrorIs(t, f.flushed(t).Err, context.DeadlineExceeded)
	require.Len(t, f.logs.records(t, "keel: death alert not delivered"), 1)
}

func TestShutdownDuringSendKeepsTheDeaths(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	calls := 0
	got := make(chan []byte, 10)
	srv := httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		mu.Lock()
		calls++
		n := calls
		mu.Unlock()
		body, _ := io.ReadAll(r.Body)
		if n == 1 {
			rw.WriteHeader(http.StatusBadGateway) // the window's send is retrying when Run is stopped
			return
		}
		got <- body
	}))
	defer srv.Close()
	f := newAlerter(t, srv.URL, func(c *alert.Config) { c.RetryBackoff = time.Hour })
	stop := f.run(t)
	f.alerter.JobDied(context.Background(), death(1, "order:charge", "transient"))
	require.ErrorContains(t, f.signals.Retrying.Wait(t), "502")
	f.alerter.JobDied(context.Background(), death(2, "order:charge", "transient"))

	stop()
	select {
	case body := <-got:
		var s alert.Summary
		require.NoError(t, json.Unmarshal(body, &s))
		require.Equal(t, 2, s.Count, "the interrupted window and the new death go out together")
		require.Equal(t, "job-01", s.Examples[0].JobID)
	default:
		t.Fatal("the final flush did not send the interrupted window")
	}
}

func TestJobDiedNeverWaits(t *testing.T) {
	t.Parallel()
	hook := newWebhook(t, nil)
	f := newAlerter(t, hook.srv.URL, nil)
	ctx := context.Background()

	// Nobody is running the webhook yet; deaths must not pile up in memory
	// nor make the worker wait.
	const n = 20000
	start := time.Now()
	for i := range n {
		f.alerter.JobDied(ctx, death(i, fmt.Sprintf("kind:%d", i%(2*alert.MaxGroups)), "transient"))
	}
	require.Less(t, time.Since(start), 10*time.Second)

	f.run(t)
	var s alert.Summary
	require.NoError(t, json.Unmarshal(hook.next(t), &s))
	require.Equal(t, n, s.Count)
	require.Len(t, s.ByKind, alert.MaxGroups+1, "groups past MaxGroups are folded together")
	total := 0
	for _, c := range s.ByKind {
		total += c
	}
	require.Equal(t, n, total)
	require.Equal(t, n-alert.MaxGroups*(n/(2*alert.MaxGroups)), s.ByKind[alert.OtherGroup])
	require.Len(t, s.Examples, alert.MaxExamples)
	require.Equal(t, alert.Flushed{Deaths: n}, f.flushed(t))
	hook.quiet(t)
}

func TestWithoutWebhookDeathsAreLoggedAndCounted(t *testing.T) {
	t.Parallel()
	f := newAlerter(t, "", nil)
	stop := f.run(t)
	f.alerter.JobDied(context.Background(), death(1, "order:charge", "permanent"))
	stop()
	require.Len(t, f.logs.records(t, "keel: job died"), 1)
	n, err := testutil.GatherAndCount(f.reg, alert.MetricName)
	require.NoError(t, err)
	require.Equal(t, 1, n)
}

func TestCounterIsSharedOnOneRegistry(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	a1, err := alert.New(alert.Config{Registerer: reg, Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	a2, err := alert.New(alert.Config{Registerer: reg, Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err, "a second alerter on one registry shares the counter")
	a1.JobDied(context.Background(), death(1, "order:charge", "permanent"))
	a2.JobDied(context.Background(), death(2, "order:charge", "permanent"))
	require.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP keel_jobs_dead_total Jobs moved to the dead letters, by error class.
# TYPE keel_jobs_dead_total counter
keel_jobs_dead_total{class="permanent",kind="order:charge",queue="default"} 2
`), alert.MetricName))

	clash := prometheus.NewRegistry()
	clash.MustRegister(prometheus.NewGauge(prometheus.GaugeOpts{Name: alert.MetricName, Help: "something else"}))
	_, err = alert.New(alert.Config{Registerer: clash})
	require.Error(t, err)
}

func TestRunTwiceIsRefused(t *testing.T) {
	t.Parallel()
	hook := newWebhook(t, nil)
	f := newAlerter(t, hook.srv.URL, nil)
	f.run(t)
	f.alerter.JobDied(context.Background(), death(1, "order:charge", "permanent"))
	hook.next(t) // Run is surely running
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	require.ErrorIs(t, f.alerter.Run(ctx), alert.ErrRunning)
}

func TestNewRejectsBadConfig(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		name string
		cfg  alert.Config
		want string // "" for valid
	}{
		{name: "no webhook", cfg: alert.Config{}},
		{name: "https", cfg: alert.Config{WebhookURL: "https://hooks.example.com/services/T0/B0/x"}},
		{name: "http with port", cfg: alert.Config{WebhookURL: "http://127.0.0.1:9000/hook"}},
		{name: "unparsable", cfg: alert.Config{WebhookURL: "http://exa mple.com/"}, want: "WebhookURL"},
		{name: "no scheme", cfg: alert.Config{WebhookURL: "hooks.example.com/x"}, want: "WebhookURL has no scheme: want an http:// or https:// URL"},
		{name: "other scheme", cfg: alert.Config{WebhookURL: "ftp://hooks.example.com/x"}, want: "scheme"},
		{name: "no host", cfg: alert.Config{WebhookURL: "https:///x"}, want: "no host"},
		{name: "secret not echoed", cfg: alert.Config{WebhookURL: "ftp://user:pw@hooks.example.com/s3cret?token=s3cret"}, want: `"ftp://hooks.example.com/…"`},
		{name: "secret not echoed when unparsable", cfg: alert.Config{WebhookURL: "http://hooks.example.com/s3cret%zz"}, want: "does not parse"},
		{name: "negative window", cfg: alert.Config{Window: -time.Second}, want: "Window"},
		{name: "negative attempts", cfg: alert.Config{MaxAttempts: -1}, want: "MaxAttempts"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			tt.cfg.Registerer = prometheus.NewRegistry()
			a, err := alert.New(tt.cfg)
			if tt.want == "" {
				require.NoError(t, err)
				require.NotNil(t, a)
				return
			}
			require.ErrorContains(t, err, tt.want)
			require.NotContains(t, err.Error(), "s3cret")
			require.NotContains(t, err.Error(), "pw@")
		})
	}
}

func TestDefaults(t *testing.T) {
	t.Parallel()
	c := alert.Config{}.WithDefaults()
	require.Equal(t, 30*time.Second, c.Window)
	require.Equal(t, 5, c.MaxAttempts)
	require.Equal(t, time.Second, c.RetryBackoff)
	require.Equal(t, 10*time.Second, c.HTTPClient.Timeout)
	require.Equal(t, 5*time.Second, c.FlushTimeout)
	require.Equal(t, prometheus.DefaultRegisterer, c.Registerer)
	require.NotNil(t, c.Logger)
}
