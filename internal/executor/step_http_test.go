package executor_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/inspect"
	"github.com/keeljobs/keel/retry"
	"github.com/keeljobs/keel/tasks"
)

// cut answers a call by closing the connection without a reply.
const cut = 0

// provider is a fake external API that is NOT idempotent: it applies every
// call it accepts, whatever its Idempotency-Key, and counts what reaches it.
// A fake that deduplicated could not show that keel does not send twice.
type provider struct {
	*httptest.Server
	mu       sync.Mutex
	requests []string       // the Idempotency-Key of every request to /call received
	applied  map[string]int // key → how many times the call took effect
	// answer decides the reply to the nth request (1-based): a 2xx applies
	// the call and answers, cut applies it and closes the connection, any
	// other status refuses it.
	answer func(n int) int
}

func newProvider(t *testing.T, answer func(n int) int) *provider {
	p := &provider{applied: map[string]int{}, answer: answer}
	p.Server = httptest.NewServer(http.HandlerFunc(p.serve))
	t.Cleanup(p.Close)
	return p
}

func (p *provider) serve(w http.ResponseWriter, r *http.Request) {
	key := r.Header.Get("Idempotency-Key")
	switch {
	case r.Method == http.MethodGet && r.URL.Path == "/sent":
		p.mu.Lock()
		n := p.applied[r.URL.Query().Get("key")]
		p.mu.Unlock()
		if n == 0 {
			http.NotFound(w, r)
		}
		return
	case r.URL.Path == "/call":
	default:
		http.NotFound(w, r)
		return
	}
	_, _ = io.Copy(io.Discard, r.Body)
	p.mu.Lock()
	p.requests = append(p.requests, key)
	status := p.answer(len(p.requests))
	if status == cut || status < 300 {
		p.applied[key]++
	}
	p.mu.Unlock()
	if status != cut {
		w.WriteHeader(status)
		return
	}
	c, _, err := w.(http.Hijacker).Hijack()
	if err != nil {
		panic(err)
	}
	c.Close()
}

func (p *provider) counts() (requests, applied int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, n := range p.applied {
		applied += n
	}
	return len(p.requests), applied
}

func (p *provider) keys() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]string(nil), p.requests...)
}

func (p *provider) post(ctx context.Context, key string) (*http.Request, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, p.URL+"/call", strings.NewReader(`{"amount":42}`))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Idempotency-Key", key)
	req.Header.Set("Content-Type", "application/json")
	return req, nil
}

// fewRetries is a kind with a small budget, so a job that keeps failing
// dies within a test's patience.
var fewRetries = tasks.Define[order]("test:few_retries", tasks.MaxRetry(2),
	tasks.Key(func(o order) string { return "order:" + o.OrderID }))

// A client that only returns its transport's error cannot say whether the
// call reached the other side: the step stays in doubt, and with no Verify
// the job is parked for a person instead of calling again.
func TestStepWithRawTransportErrorIsNotRepeated(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	p := newProvider(t, func(int) int { return cut })
	client := &http.Client{Timeout: 5 * time.Second}
	mux := tasks.NewMux()
	tasks.Handle(mux, fewRetries, func(ctx context.Context, o order) error {
		return idempotency.Step(ctx, "charge", func(ctx context.Context, key string) error {
			req, err := p.post(ctx, key)
			if err != nil {
				return err
			}
			resp, err := client.Do(req)
			if err != nil {
				return err // the raw transport error: EOF, reset, timeout
			}
			resp.Body.Close()
			return retry.FromResponse(resp)
		})
	})
	res, err := b.client.Enqueue(ctx, fewRetries.New(order{OrderID: "raw"}))
	require.NoError(t, err)
	b.startWorker(t, mux, nil)
	j := b.waitStatus(t, res.Job.ID, idempotency.StatusDead, 20*time.Second)
	requests, applied := p.counts()
	require.Equal(t, 1, requests, "a call that may have happened was sent again")
	require.Equal(t, 1, applied)
	require.Contains(t, j.LastError, idempotency.ErrInDoubt.Error())
	steps, err := b.store.Steps(ctx, res.Job.ID)
	require.NoError(t, err)
	require.Len(t, steps, 1)
	require.Equal(t, "started", steps[0].Status, "the step must stay in doubt for a person")
}

func (p *provider) sent(ctx context.Context, key string) (bool, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, p.URL+"/sent?key="+url.QueryEscape(key), nil)
	if err != nil {
		return false, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return false, err
	}
	resp.Body.Close()
	return resp.StatusCode == http.StatusOK, nil
}

// newCall builds the request StepHTTP sends: no key header of its own, the
// helper sets it.
func (p *provider) newCall(ctx context.Context, _ string) (*http.Request, error) {
	return http.NewRequestWithContext(ctx, http.MethodPost, p.URL+"/call", strings.NewReader(`{"amount":42}`))
}

// The connection is cut after the call took effect: the next attempt asks
// the provider through Verify, finds the call, and never sends it again.
func TestHTTPStepInDoubtIsVerifiedAndAppliedOnce(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	p := newProvider(t, func(n int) int {
		if n == 1 {
			return cut
		}
		return http.StatusOK
	})
	client := &http.Client{Timeout: 5 * time.Second}
	mux := tasks.NewMux()
	tasks.Handle(mux, fewRetries, func(ctx context.Context, o order) error {
		return idempotency.StepHTTP(ctx, "charge", client, p.newCall, idempotency.Verify(p.sent))
	})
	res, err := b.client.Enqueue(ctx, fewRetries.New(order{OrderID: "verified"}))
	require.NoError(t, err)
	b.startWorker(t, mux, nil)
	j := b.waitStatus(t, res.Job.ID, idempotency.StatusSucceeded, 20*time.Second)
	requests, applied := p.counts()
	require.Equal(t, 1, requests, "a call in doubt was sent again instead of verified")
	require.Equal(t, 1, applied)
	require.Equal(t, []string{idempotency.StepKey(res.Job.ID, "charge")}, p.keys(), "the step key must be the Idempotency-Key")
	require.Equal(t, 2, j.Attempts, "the doubt must be settled by a second attempt")
	steps, err := b.store.Steps(ctx, res.Job.ID)
	require.NoError(t, err)
	require.Len(t, steps, 1)
	require.Equal(t, "done", steps[0].Status)
}

// A call that could not connect never left: the step runs again, and the
// service that comes up later receives it once.
func TestHTTPStepNotSentIsRetried(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := l.Addr().String()
	require.NoError(t, l.Close()) // nothing listens there yet

	var mu sync.Mutex
	var p *provider // the service, once it is up
	client := &http.Client{Timeout: 5 * time.Second}
	mux := tasks.NewMux()
	tasks.Handle(mux, receipt, func(ctx context.Context, o order) error {
		return idempotency.StepHTTP(ctx, "charge", client, func(ctx context.Context, key string) (*http.Request, error) {
			return http.NewRequestWithContext(ctx, http.MethodPost, "http://"+addr+"/call", strings.NewReader(`{}`))
		}, idempotency.Verify(func(ctx context.Context, key string) (bool, error) {
			mu.Lock()
			defer mu.Unlock()
			if p == nil {
				return false, errors.New("Verify must not be needed: the call was never sent")
			}
			return p.sent(ctx, key)
		}))
	})
	res, err := b.client.Enqueue(ctx, receipt.New(order{OrderID: "dial"}))
	require.NoError(t, err)
	b.startWorker(t, mux, nil)
	j := b.waitStatus(t, res.Job.ID, idempotency.StatusFailed, 15*time.Second)
	require.Contains(t, j.LastError, idempotency.ErrNotSent.Error())
	require.Equal(t, string(retry.ClassTransient), j.ErrorClass)
	steps, err := b.store.Steps(ctx, res.Job.ID)
	require.NoError(t, err)
	require.Empty(t, steps, "a step that was never sent must not stay in doubt")

	l, err = net.Listen("tcp", addr)
	require.NoError(t, err)
	mu.Lock()
	p = &provider{applied: map[string]int{}, answer: func(int) int { return http.StatusOK }}
	p.Server = &httptest.Server{Listener: l, Config: &http.Server{Handler: http.HandlerFunc(p.serve)}}
	p.Start()
	mu.Unlock()
	t.Cleanup(p.Close)

	b.waitStatus(t, res.Job.ID, idempotency.StatusSucceeded, 20*time.Second)
	requests, applied := p.counts()
	require.Equal(t, 1, requests)
	require.Equal(t, 1, applied)
}

// An answer says what happened: a 4xx refused the call for good, a 503 asks
// for a retry with the same key, and a gateway's 504 proves nothing.
func TestHTTPStepAnswers(t *testing.T) {
	t.Run("422 is permanent and not in doubt", func(t *testing.T) {
		b := setup(t)
		p := newProvider(t, func(int) int { return http.StatusUnprocessableEntity })
		j := runHTTPStep(t, b, p, idempotency.StatusDead, nil)
		require.Equal(t, 1, j.Attempts)
		require.Equal(t, string(retry.ClassPermanent), j.ErrorClass)
		require.Contains(t, j.LastError, "422")
		require.NotContains(t, j.LastError, "in doubt")
		requests, applied := p.counts()
		require.Equal(t, 1, requests)
		require.Equal(t, 0, applied)
		steps, err := b.store.Steps(context.Background(), j.ID)
		require.NoError(t, err)
		require.Empty(t, steps, "a refused call must not stay in doubt (a replay calls it again)")
	})
	t.Run("503 is verified, then retried with the same key", func(t *testing.T) {
		// A 5xx may come after the effect: in doubt, settled by Verify.
		b := setup(t)
		p := newProvider(t, func(n int) int {
			if n <= 2 {
				return http.StatusServiceUnavailable
			}
			return http.StatusOK
		})
		j := runHTTPStep(t, b, p, idempotency.StatusSucceeded, idempotency.Verify(p.sent))
		require.Equal(t, 3, j.Attempts)
		requests, applied := p.counts()
		require.Equal(t, 3, requests)
		require.Equal(t, 1, applied)
		key := idempotency.StepKey(j.ID, "charge")
		require.Equal(t, []string{key, key, key}, p.keys())
	})
	t.Run("504 without Verify is parked", func(t *testing.T) {
		b := setup(t)
		p := newProvider(t, func(int) int { return http.StatusGatewayTimeout })
		j := runHTTPStep(t, b, p, idempotency.StatusDead, nil)
		require.Equal(t, 1, j.Attempts)
		require.Contains(t, j.LastError, idempotency.ErrInDoubt.Error())
		requests, _ := p.counts()
		require.Equal(t, 1, requests)
	})
	t.Run("504 with Verify is verified, then sent again", func(t *testing.T) {
		b := setup(t)
		p := newProvider(t, func(n int) int {
			if n == 1 {
				return http.StatusGatewayTimeout
			}
			return http.StatusOK
		})
		j := runHTTPStep(t, b, p, idempotency.StatusSucceeded, idempotency.Verify(p.sent))
		require.Equal(t, 2, j.Attempts)
		requests, applied := p.counts()
		require.Equal(t, 2, requests, "verified as not applied: sent once more")
		require.Equal(t, 1, applied)
	})
}

func runHTTPStep(t *testing.T, b *bundle, p *provider, want idempotency.Status, verify idempotency.StepOption) idempotency.Job {
	t.Helper()
	var opts []idempotency.StepOption
	if verify != nil {
		opts = append(opts, verify)
	}
	client := &http.Client{Timeout: 5 * time.Second}
	mux := tasks.NewMux()
	tasks.Handle(mux, fewRetries, func(ctx context.Context, o order) error {
		return idempotency.StepHTTP(ctx, "charge", client, p.newCall, opts...)
	})
	res, err := b.client.Enqueue(context.Background(), fewRetries.New(order{OrderID: "answers"}))
	require.NoError(t, err)
	b.startWorker(t, mux, nil)
	return b.waitStatus(t, res.Job.ID, want, 20*time.Second)
}

// Go's http.Transport sends a replayable request (a GET, or any request with
// an Idempotency-Key and a rewindable body) again by itself when a kept-alive
// connection breaks after it was written. DoHTTP must not let it.
func TestDoHTTPIsNeverResentByTheTransport(t *testing.T) {
	for _, method := range []string{http.MethodPost, http.MethodGet} {
		t.Run(method, func(t *testing.T) {
			// The first request warms a kept-alive connection; the second,
			// sent on it, takes effect and its connection is cut.
			answer := func(n int) int {
				if n == 2 {
					return cut
				}
				return http.StatusOK
			}
			newReq := func(p *provider) *http.Request {
				var body io.Reader
				if method == http.MethodPost {
					body = strings.NewReader(`{"amount":42}`)
				}
				req, err := http.NewRequest(method, p.URL+"/call", body)
				require.NoError(t, err)
				return req
			}
			warm := func(p *provider, client *http.Client) {
				resp, err := client.Do(newReq(p))
				require.NoError(t, err)
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}

			// The plain client shows the hazard is real here.
			plain := newProvider(t, answer)
			client := &http.Client{Transport: &http.Transport{}, Timeout: 5 * time.Second}
			defer client.CloseIdleConnections()
			warm(plain, client)
			req := newReq(plain)
			req.Header.Set("Idempotency-Key", "k")
			resp, err := client.Do(req)
			require.NoError(t, err, "the transport resent the request and got an answer")
			resp.Body.Close()
			_, applied := plain.counts()
			require.Equal(t, 3, applied, "the scenario must make a plain client send twice")

			p := newProvider(t, answer)
			client = &http.Client{Transport: &http.Transport{}, Timeout: 5 * time.Second}
			defer client.CloseIdleConnections()
			warm(p, client)
			resp, err = idempotency.DoHTTP(client, newReq(p), "k")
			require.Nil(t, resp)
			require.ErrorIs(t, err, idempotency.ErrInDoubt)
			require.NotErrorIs(t, err, idempotency.ErrNotSent)
			requests, applied := p.counts()
			require.Equal(t, 2, requests, "DoHTTP let the transport send a step's request twice")
			require.Equal(t, 2, applied)
		})
	}
}

// DoHTTP marks each way a call can end for the step around it.
func TestDoHTTPMarksOutcomes(t *testing.T) {
	var hits sync.Map // path → requests received
	hit := func(path string) int {
		n, _ := hits.Load(path)
		i, _ := n.(int)
		return i
	}
	release := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n, _ := hits.LoadOrStore(r.URL.Path, 0)
		hits.Store(r.URL.Path, n.(int)+1)
		switch r.URL.Path {
		case "/ok":
			if r.Header.Get("Idempotency-Key") != "job:step" {
				w.WriteHeader(http.StatusBadRequest)
				return
			}
			_, _ = io.WriteString(w, "done")
		case "/redirect":
			http.Redirect(w, r, "/ok", http.StatusTemporaryRedirect)
		case "/see-other":
			// Done; the result is read elsewhere, and that read fails.
			http.Redirect(w, r, "/429", http.StatusSeeOther)
		case "/moved":
			http.Redirect(w, r, "/404", http.StatusFound)
		case "/slow":
			<-release
		default:
			code, _ := strconv.Atoi(strings.TrimPrefix(r.URL.Path, "/"))
			w.Header().Set("Retry-After", "7")
			w.WriteHeader(code)
		}
	}))
	defer srv.Close()
	defer close(release)
	client := &http.Client{Timeout: 5 * time.Second}
	do := func(c *http.Client, url string) (*http.Response, error) {
		req, err := http.NewRequest(http.MethodPost, url, strings.NewReader("x"))
		require.NoError(t, err)
		return idempotency.DoHTTP(c, req, "job:step")
	}

	resp, err := do(client, srv.URL+"/ok")
	require.NoError(t, err)
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.Equal(t, "done", string(body), "the key header must be set and the body left to the caller")

	_, err = do(client, srv.URL+"/422")
	require.ErrorIs(t, err, retry.ErrPermanent)
	require.NotErrorIs(t, err, idempotency.ErrInDoubt)
	var he *retry.HTTPError
	require.ErrorAs(t, err, &he)

	// A 5xx may come after the effect: in doubt, and still transient (with
	// its Retry-After) so that the next attempt verifies it.
	_, err = do(client, srv.URL+"/500")
	require.ErrorIs(t, err, retry.ErrTransient)
	require.ErrorIs(t, err, idempotency.ErrInDoubt)
	e, _ := retry.Marked(err)
	require.Equal(t, 7*time.Second, e.Delay)

	for _, gateway := range []string{"/502", "/504"} {
		_, err = do(client, srv.URL+gateway)
		require.ErrorIs(t, err, idempotency.ErrInDoubt, gateway)
	}

	_, err = do(client, srv.URL+"/redirect")
	require.ErrorIs(t, err, retry.ErrPermanent)
	require.ErrorContains(t, err, "not followed")
	require.Equal(t, 1, hit("/ok"), "a 307 must not send the request again")

	// A redirect the client followed answered the request itself: a
	// failure of its target says nothing of the request's effect.
	for _, path := range []string{"/see-other", "/moved"} {
		_, err = do(client, srv.URL+path)
		require.ErrorIs(t, err, idempotency.ErrInDoubt, path)
		require.ErrorContains(t, err, "redirect", path)
	}

	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	closed := "http://" + l.Addr().String() + "/ok"
	require.NoError(t, l.Close())
	_, err = do(client, closed)
	require.ErrorIs(t, err, idempotency.ErrNotSent, "a refused connection never carried the request")
	require.Equal(t, retry.ClassTransient, retry.Default.Classify(err))

	_, err = do(client, "ftp://example.com/")
	require.ErrorIs(t, err, idempotency.ErrNotSent, "a request the transport refuses is not sent")

	_, err = do(&http.Client{Timeout: time.Second}, srv.URL+"/slow")
	require.ErrorIs(t, err, idempotency.ErrInDoubt, "a timeout after the request was written is in doubt")
	require.NotErrorIs(t, err, idempotency.ErrNotSent)

	// A transport that reports nothing through httptrace proves nothing.
	opaque := &http.Client{Transport: roundTripFunc(func(*http.Request) (*http.Response, error) {
		return nil, errors.New("connection reset by peer")
	})}
	_, err = do(opaque, srv.URL+"/ok")
	require.ErrorIs(t, err, idempotency.ErrInDoubt)
}

type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

// A step after the completing InTx would run outside the job's record: it
// is refused with a clear error, and its call never happens.
func TestStepAfterInTxDoesNotRun(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	var calls atomic.Int32
	stepErr := make(chan error, 1)
	mux := tasks.NewMux()
	tasks.Handle(mux, receipt, func(ctx context.Context, o order) error {
		if err := idempotency.InTx(ctx, func(pgx.Tx) error { return nil }); err != nil {
			return err
		}
		err := idempotency.Step(ctx, "mail", func(context.Context, string) error {
			calls.Add(1)
			return nil
		})
		stepErr <- err
		return err
	})
	_, err := b.client.Enqueue(ctx, receipt.New(order{OrderID: "late-step"}))
	require.NoError(t, err)
	b.startWorker(t, mux, nil)
	var got error
	select {
	case got = <-stepErr:
	case <-time.After(15 * time.Second):
		t.Fatal("the handler never ran")
	}
	require.ErrorIs(t, got, idempotency.ErrStepAfterComplete)
	require.ErrorIs(t, got, retry.ErrPermanent)
	require.ErrorContains(t, got, `step "mail" did not run`)
	require.Zero(t, calls.Load(), "a step after the completing InTx made its call")
}

func TestStepErrorMarks(t *testing.T) {
	require.NoError(t, idempotency.NotSent(nil))
	require.NoError(t, idempotency.InDoubt(nil))
	base := errors.New("dial tcp: connection refused")
	ns := idempotency.NotSent(retry.Transient(base))
	require.ErrorIs(t, ns, idempotency.ErrNotSent)
	require.ErrorIs(t, ns, base)
	require.Equal(t, retry.ClassTransient, retry.Default.Classify(ns), "NotSent keeps the error's class")
}

// resendingTransport is a retrying RoundTripper of the kind some clients
// install: it keeps the body and sends the request again after an error.
type resendingTransport struct{ next http.RoundTripper }

func (rt resendingTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	body, err := io.ReadAll(req.Body)
	if err != nil {
		return nil, err
	}
	req.Body.Close()
	for try := 0; ; try++ {
		r := req.Clone(req.Context())
		r.Body = io.NopCloser(bytes.NewReader(body))
		resp, err := rt.next.RoundTrip(r)
		if err == nil || try == 1 {
			return resp, err
		}
	}
}

// A layer DoHTTP cannot switch off may still send a step's request twice:
// DoHTTP says so, and the step waits for a person even with a Verify, which
// could only confirm that the call happened, not that it happened twice.
func TestDoHTTPReportsAResend(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	p := newProvider(t, func(n int) int {
		if n == 1 {
			return cut
		}
		return http.StatusOK
	})
	client := &http.Client{Transport: resendingTransport{next: &http.Transport{}}, Timeout: 5 * time.Second}
	defer client.CloseIdleConnections()
	var stepErr atomic.Value
	mux := tasks.NewMux()
	tasks.Handle(mux, receipt, func(ctx context.Context, o order) error {
		err := idempotency.StepHTTP(ctx, "charge", client, p.newCall, idempotency.Verify(p.sent))
		stepErr.Store(err)
		return err
	})
	res, err := b.client.Enqueue(ctx, receipt.New(order{OrderID: "resent"}))
	require.NoError(t, err)
	b.startWorker(t, mux, nil)
	j := b.waitStatus(t, res.Job.ID, idempotency.StatusDead, 15*time.Second)
	err, _ = stepErr.Load().(error)
	require.ErrorIs(t, err, idempotency.ErrResent)
	require.ErrorIs(t, err, idempotency.ErrInDoubt)
	require.ErrorIs(t, err, retry.ErrPermanent)
	require.Contains(t, j.LastError, idempotency.ErrInDoubt.Error())
	require.Equal(t, 1, j.Attempts)
	_, applied := p.counts()
	require.Equal(t, 2, applied, "the resending layer did send twice")
	// Nor does a replay settle it by Verify in a person's place.
	steps, err := b.store.Steps(ctx, res.Job.ID)
	require.NoError(t, err)
	require.False(t, steps[0].Verifiable)
	_, err = checkReplay(t, b.store, res.Job.ID)
	require.ErrorIs(t, err, inspect.ErrStepsInDoubt)
}

// A 303 after a POST says the work is done and the result is elsewhere;
// when reading it fails (rate limited once), the charge is not sent again.
func TestFollowedRedirectAfterTheEffectIsNotARefusal(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	var posts, gets atomic.Int32
	api := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodPost {
			posts.Add(1)
			w.Header().Set("Location", "/charges/1")
			w.WriteHeader(http.StatusSeeOther)
			return
		}
		if gets.Add(1) == 1 {
			w.WriteHeader(http.StatusTooManyRequests)
			return
		}
		w.WriteHeader(http.StatusOK)
	}))
	defer api.Close()
	client := &http.Client{Timeout: 5 * time.Second}
	mux := tasks.NewMux()
	tasks.Handle(mux, fewRetries, func(ctx context.Context, o order) error {
		return idempotency.StepHTTP(ctx, "charge", client, func(ctx context.Context, key string) (*http.Request, error) {
			return http.NewRequestWithContext(ctx, http.MethodPost, api.URL+"/charges", strings.NewReader(`{"amount":42}`))
		})
	})
	res, err := b.client.Enqueue(ctx, fewRetries.New(order{OrderID: "redirected"}))
	require.NoError(t, err)
	b.startWorker(t, mux, nil)
	j := b.waitStatus(t, res.Job.ID, idempotency.StatusDead, 20*time.Second)
	require.Contains(t, j.LastError, "in doubt")
	require.EqualValues(t, 1, posts.Load(), "the charge the server confirmed with a 303 was sent again")
}

// A run that loses its job while its Verify looks (the lease taken over)
// does not go on to call: the newer run decides.
func TestStepDoesNotCallAfterLosingTheJobDuringVerify(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	var calls atomic.Int32
	returned := make(chan error, 1)
	mux := tasks.NewMux()
	tasks.Handle(mux, fewRetries, func(ctx context.Context, o order) error {
		err := idempotency.Step(ctx, "charge", func(ctx context.Context, key string) error {
			calls.Add(1)
			return nil
		}, idempotency.Verify(func(ctx context.Context, key string) (bool, error) {
			// Meanwhile another worker took the job over.
			_, err := b.pool.Exec(ctx, `UPDATE keel_jobs SET lease_holder = 'another-worker', last_holder = 'another-worker',
				attempts = attempts + 1 WHERE id = $1`, mustJobID(ctx))
			return false, err
		}))
		select {
		case returned <- err:
		default:
		}
		return err
	})
	res, err := b.client.Enqueue(ctx, fewRetries.New(order{OrderID: "taken-over"}))
	require.NoError(t, err)
	_, err = b.pool.Exec(ctx, `INSERT INTO keel_steps (job_id, name, status) VALUES ($1, 'charge', 'started')`, res.Job.ID)
	require.NoError(t, err)
	b.startWorker(t, mux, nil)
	select {
	case err := <-returned:
		require.Error(t, err)
	case <-time.After(20 * time.Second):
		t.Fatal("the handler never returned")
	}
	require.Zero(t, calls.Load(), "a run that no longer held the job called after its Verify")
}
