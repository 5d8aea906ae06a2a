package handlers

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/keeljobs/keel/idempotency"
)

// Faults tells the simulated mail service how to misbehave. Shares are
// fractions of requests in [0, 1].
type Faults struct {
	ServerErrors float64       // answer 503
	RateLimited  float64       // answer 429 with Retry-After
	RetryAfter   time.Duration // the Retry-After it sends; default 2s
	// Slow is the share of mails that go out at once but whose reply is
	// held past the client's timeout: the caller's timeout cannot tell
	// whether the mail went out.
	Slow    float64
	SlowFor time.Duration // how long a slow reply is held; default 15s
	// Emails at this domain are refused with 422, a permanent error.
	BounceDomain string
	// LostReplies is the share of requests that take effect but whose reply
	// is lost (the connection is cut): the caller cannot tell, which is what
	// recorded steps and their verification exist for.
	LostReplies float64
}

// MailSim is a stand-in for an external mail API. It is deliberately not
// idempotent: every send it accepts goes out, even one with a key it has
// seen, as with a provider that ignores Idempotency-Key. It counts what it
// sends, so that "no order mailed twice" measures keel, not the simulator.
// GET /sent?key=K tells whether a mail with key K went out: the look-up a
// step's Verify uses.
type MailSim struct {
	mu     sync.Mutex
	faults Faults
	// bounce is the bouncing domain /bounces/on brings back.
	bounce  string
	rnd     *rand.Rand
	calls   int
	mails   int
	sent    map[string]int // idempotency key → mails sent with it
	byOrder map[string]int // order id → mails sent
}

// NewMailSim returns a simulated mail service.
func NewMailSim(f Faults, seed uint64) *MailSim {
	return &MailSim{faults: f, bounce: f.BounceDomain, rnd: rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15)),
		sent: map[string]int{}, byOrder: map[string]int{}}
}

// SetFaults changes the faults (the demo turns them off to let replays pass).
func (m *MailSim) SetFaults(f Faults) {
	m.mu.Lock()
	m.faults = f
	if f.BounceDomain != "" {
		m.bounce = f.BounceDomain
	}
	m.mu.Unlock()
}

// MailStats is what the service has seen.
type MailStats struct {
	// Calls is how many send requests arrived.
	Calls int `json:"calls"`
	// Mails is how many mails went out: every send that was accepted,
	// whatever its key.
	Mails int `json:"mails"`
	// OrdersMailedTwice counts orders that received more than one mail: the
	// duplicate side effects keel exists to prevent. It must stay 0.
	OrdersMailedTwice int `json:"orders_mailed_twice"`
}

// Stats returns the counters.
func (m *MailSim) Stats() MailStats {
	m.mu.Lock()
	defer m.mu.Unlock()
	st := MailStats{Calls: m.calls, Mails: m.mails}
	for _, n := range m.byOrder {
		if n > 1 {
			st.OrdersMailedTwice++
		}
	}
	return st
}

type mailRequest struct {
	Email   string `json:"email"`
	OrderID string `json:"order_id"`
}

// ServeHTTP serves POST /send, GET /sent?key=K (200 if a mail with key K
// went out, 404 if not), GET /stats, POST /bounces/off, which "fixes" the
// bouncing mailboxes so that dead receipts can be replayed successfully, and
// POST /bounces/on, which breaks them again.
func (m *MailSim) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	switch {
	case r.Method == http.MethodPost && r.URL.Path == "/bounces/off":
		m.mu.Lock()
		m.faults.BounceDomain = ""
		m.mu.Unlock()
		fmt.Fprintln(w, "bouncing mailboxes fixed: replay their dead receipts now")
	case r.Method == http.MethodPost && r.URL.Path == "/bounces/on":
		m.mu.Lock()
		m.faults.BounceDomain = m.bounce
		m.mu.Unlock()
		fmt.Fprintf(w, "mailboxes at %s bounce again\n", m.bounce)
	case r.Method == http.MethodPost && r.URL.Path == "/send":
		m.send(w, r)
	case r.Method == http.MethodGet && r.URL.Path == "/sent":
		key := r.URL.Query().Get("key")
		m.mu.Lock()
		n := m.sent[key]
		m.mu.Unlock()
		if key == "" || n == 0 {
			http.NotFound(w, r)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"key":%q,"mails":%d}`, key, n)
	case r.Method == http.MethodGet && r.URL.Path == "/stats":
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(m.Stats())
	default:
		http.NotFound(w, r)
	}
}

func (m *MailSim) send(w http.ResponseWriter, r *http.Request) {
	key := r.Header.Get("Idempotency-Key")
	var req mailRequest
	if key == "" || json.NewDecoder(r.Body).Decode(&req) != nil || req.OrderID == "" {
		http.Error(w, "need an Idempotency-Key header and a JSON body with email and order_id", http.StatusBadRequest)
		return
	}
	m.mu.Lock()
	m.calls++
	f := m.faults
	roll := m.rnd.Float64()
	m.mu.Unlock()

	switch {
	case f.BounceDomain != "" && strings.HasSuffix(req.Email, "@"+f.BounceDomain):
		http.Error(w, "mailbox does not exist", http.StatusUnprocessableEntity)
		return
	case roll < f.ServerErrors:
		http.Error(w, "upstream unavailable", http.StatusServiceUnavailable)
		return
	case roll < f.ServerErrors+f.RateLimited:
		ra := f.RetryAfter
		if ra <= 0 {
			ra = 2 * time.Second
		}
		w.Header().Set("Retry-After", strconv.Itoa(int(ra.Seconds()+0.5)))
		http.Error(w, "slow down", http.StatusTooManyRequests)
		return
	}
	// Accepted: the mail goes out, a repeated key or not.
	m.mu.Lock()
	m.mails++
	m.sent[key]++
	m.byOrder[req.OrderID]++
	m.mu.Unlock()
	switch {
	case roll < f.ServerErrors+f.RateLimited+f.Slow:
		d := f.SlowFor
		if d <= 0 {
			d = 15 * time.Second
		}
		select {
		case <-r.Context().Done(): // the caller gave up; the mail is out anyway
			return
		case <-time.After(d):
		}
	case roll > 1-f.LostReplies:
		// The mail went out; the reply never arrives.
		if hj, ok := w.(http.Hijacker); ok {
			if c, _, err := hj.Hijack(); err == nil {
				c.Close()
				return
			}
		}
	}
	w.WriteHeader(http.StatusOK)
	fmt.Fprintf(w, `{"id":%q}`, key)
}

// HTTPMailer is a Mailer that calls a mail API over HTTP (the simulator in
// the demo). It sends with idempotency.DoHTTP, so its errors say whether a
// failed send can have gone out, and it implements MailVerifier with the
// API's look-up by key.
type HTTPMailer struct {
	BaseURL string
	Client  *http.Client
}

// SendReceipt posts the mail once, with its idempotency key.
func (h HTTPMailer) SendReceipt(ctx context.Context, key, email, orderID string) error {
	body, err := json.Marshal(mailRequest{Email: email, OrderID: orderID})
	if err != nil {
		return idempotency.NotSent(err)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, h.BaseURL+"/send", bytes.NewReader(body))
	if err != nil {
		return idempotency.NotSent(err)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := idempotency.DoHTTP(h.client(), req, key)
	if err != nil {
		return err
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	return resp.Body.Close()
}

// Sent asks the mail API whether a mail with this key went out: the Verify
// of the mail step, which settles a send in doubt (a lost reply, a timeout,
// a worker that died mid-call).
func (h HTTPMailer) Sent(ctx context.Context, key string) (bool, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, h.BaseURL+"/sent?key="+url.QueryEscape(key), nil)
	if err != nil {
		return false, err
	}
	resp, err := h.client().Do(req)
	if err != nil {
		return false, err
	}
	defer resp.Body.Close()
	switch resp.StatusCode {
	case http.StatusOK:
		return true, nil
	case http.StatusNotFound:
		return false, nil
	}
	return false, retryFromResponse(resp)
}

func (h HTTPMailer) client() *http.Client {
	if h.Client != nil {
		return h.Client
	}
	return &http.Client{Timeout: 5 * time.Second}
}
