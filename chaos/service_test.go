package chaos_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"net/url"
	"sync"
	"time"
)

// fakeService is an external payment API that is not idempotent: it applies
// every charge it receives, whatever its key, and only counts them per key.
// It runs in the parent, so it outlives the workers the soak kills. Some
// requests it answers badly, as real networks do:
//
//   - dropped: applied, then the connection is closed without an answer;
//   - late: applied, answered only after the client gave up waiting;
//   - refused: the connection is closed before anything is applied.
//
// To the client the three look the same (a raw transport error after the
// request was written); only Verify, which asks GET /calls, tells them apart.
type fakeService struct {
	srv *httptest.Server

	mu      sync.Mutex
	calls   map[string]int    // step key → charges applied
	owner   map[string]string // step key → business key
	dropped int
	late    int
	refused int
	checks  int // look-ups by Verify
	absent  int // of which found no charge
	// lateCalls are chargeLate's calls received.
	lateCalls int
}

// Fault rates of fakeService, per charge request.
const (
	serviceDrop   = 0.10
	serviceLate   = 0.10
	serviceRefuse = 0.10
	// serviceClientTimeout is the workers' client timeout; a late answer
	// comes after it.
	serviceClientTimeout = 500 * time.Millisecond
)

func newFakeService() *fakeService {
	s := &fakeService{calls: map[string]int{}, owner: map[string]string{}}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /charge", s.charge)
	mux.HandleFunc("GET /calls", s.lookup)
	s.srv = httptest.NewServer(mux)
	return s
}

func (s *fakeService) URL() string { return s.srv.URL }

func (s *fakeService) Close() { s.srv.Close() }

func (s *fakeService) charge(w http.ResponseWriter, r *http.Request) {
	key, owner := r.URL.Query().Get("key"), r.URL.Query().Get("order")
	if key == "" {
		http.Error(w, "no key", http.StatusBadRequest)
		return
	}
	if r.URL.Query().Get("late") != "" {
		// A late call (chargeLate): applied and answered, no faults.
		s.mu.Lock()
		s.calls[key]++
		s.owner[key] = owner
		s.lateCalls++
		s.mu.Unlock()
		w.WriteHeader(http.StatusOK)
		return
	}
	p := rand.Float64()
	if p < serviceRefuse {
		s.mu.Lock()
		s.refused++
		s.mu.Unlock()
		hangUp(w)
		return
	}
	s.mu.Lock()
	s.calls[key]++
	s.owner[key] = owner
	switch {
	case p < serviceRefuse+serviceDrop:
		s.dropped++
	case p < serviceRefuse+serviceDrop+serviceLate:
		s.late++
	}
	s.mu.Unlock()
	switch {
	case p < serviceRefuse+serviceDrop:
		hangUp(w)
	case p < serviceRefuse+serviceDrop+serviceLate:
		// The client times out and closes the connection first.
		t := time.NewTimer(10 * serviceClientTimeout)
		defer t.Stop()
		select {
		case <-r.Context().Done():
		case <-t.C:
		}
		w.WriteHeader(http.StatusOK)
	default:
		w.WriteHeader(http.StatusOK)
	}
}

// hangUp closes the request's connection without an answer.
func hangUp(w http.ResponseWriter) {
	conn, _, err := http.NewResponseController(w).Hijack()
	if err != nil {
		panic(http.ErrAbortHandler) // closes the connection too
	}
	_ = conn.Close()
}

func (s *fakeService) lookup(w http.ResponseWriter, r *http.Request) {
	key := r.URL.Query().Get("key")
	s.mu.Lock()
	n := s.calls[key]
	s.checks++
	if n == 0 {
		s.absent++
	}
	s.mu.Unlock()
	fmt.Fprint(w, n)
}

// serviceStats is what the final check reads.
type serviceStats struct {
	byStep                         map[string]int
	byOrder                        map[string]int
	dropped, late, refused, checks int
	absent, lateCalls              int
}

func (s *fakeService) stats() serviceStats {
	s.mu.Lock()
	defer s.mu.Unlock()
	st := serviceStats{byStep: map[string]int{}, byOrder: map[string]int{}, dropped: s.dropped, late: s.late,
		refused: s.refused, checks: s.checks, absent: s.absent, lateCalls: s.lateCalls}
	for k, n := range s.calls {
		st.byStep[k] = n
		st.byOrder[s.owner[k]] += n
	}
	return st
}

// serviceClient is how the workers call fakeService: a plain client whose
// errors reach Step raw, marked neither NotSent nor InDoubt, as most
// hand-written clients' are. The key travels in the query, not in an
// Idempotency-Key header: with that header Go's transport would resend a
// request on a broken kept-alive connection by itself.
type serviceClient struct {
	base string
	http *http.Client
}

func newServiceClient(base string) *serviceClient {
	return &serviceClient{base: base, http: &http.Client{Timeout: serviceClientTimeout}}
}

func (c *serviceClient) charge(ctx context.Context, key, order string) error {
	return c.post(ctx, key, url.Values{"key": {key}, "order": {order}})
}

// chargeLate is a charge whose client ignores its context: it sends the
// request once hold returns, whether the run that asked for it still runs
// or not, and the service applies it.
func (c *serviceClient) chargeLate(key, order string, hold func()) error {
	hold()
	return c.post(context.Background(), key, url.Values{"key": {key}, "order": {order}, "late": {"1"}})
}

func (c *serviceClient) post(ctx context.Context, key string, q url.Values) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, c.base+"/charge?"+q.Encode(), http.NoBody)
	if err != nil {
		return err
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return err
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("charge %s: status %d", key, resp.StatusCode)
	}
	return nil
}

// charged is the step's Verify: it asks the service whether the key was
// charged.
func (c *serviceClient) charged(ctx context.Context, key string) (bool, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, c.base+"/calls?"+url.Values{"key": {key}}.Encode(), nil)
	if err != nil {
		return false, err
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return false, err
	}
	defer resp.Body.Close()
	var n int
	if _, err := fmt.Fscan(resp.Body, &n); err != nil {
		return false, fmt.Errorf("charged %s: %w", key, err)
	}
	return n > 0, nil
}
