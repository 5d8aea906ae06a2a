package handlers_test

import (
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/handlers"
)

func send(t *testing.T, base, key, orderID string) int {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, base+"/send",
		strings.NewReader(`{"email":"a@example.com","order_id":"`+orderID+`"}`))
	require.NoError(t, err)
	req.Header.Set("Idempotency-Key", key)
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	resp.Body.Close()
	return resp.StatusCode
}

func sentStatus(t *testing.T, base, key string) int {
	t.Helper()
	resp, err := http.Get(base + "/sent?key=" + url.QueryEscape(key))
	require.NoError(t, err)
	resp.Body.Close()
	return resp.StatusCode
}

// The simulated mail service is not idempotent: every send it receives goes
// out, so the demo's "mailed twice" counts keel's duplicates, not the
// simulator's tolerance of them.
func TestMailSimAppliesEverySend(t *testing.T) {
	m := handlers.NewMailSim(handlers.Faults{}, 1)
	srv := httptest.NewServer(m)
	defer srv.Close()

	require.Equal(t, http.StatusNotFound, sentStatus(t, srv.URL, "job-1:mail"))
	require.Equal(t, http.StatusOK, send(t, srv.URL, "job-1:mail", "o1"))
	require.Equal(t, http.StatusOK, sentStatus(t, srv.URL, "job-1:mail"), "the look-up must find a sent key")
	require.Equal(t, http.StatusOK, send(t, srv.URL, "job-1:mail", "o1"))
	require.Equal(t, http.StatusOK, send(t, srv.URL, "job-2:mail", "o2"))

	st := m.Stats()
	require.Equal(t, 3, st.Calls)
	require.Equal(t, 3, st.Mails, "a repeated key must be sent again, as by a provider that does not dedupe")
	require.Equal(t, 1, st.OrdersMailedTwice)
	require.Equal(t, http.StatusNotFound, sentStatus(t, srv.URL, "job-3:mail"))
}

// The tour fixes the bouncing mailboxes with /bounces/off; /bounces/on
// breaks them again, for a second go.
func TestMailSimBouncesOffAndOnAgain(t *testing.T) {
	m := handlers.NewMailSim(handlers.Faults{BounceDomain: "bounce.example"}, 1)
	srv := httptest.NewServer(m)
	defer srv.Close()
	post := func(path string) {
		resp, err := http.Post(srv.URL+path, "text/plain", nil)
		require.NoError(t, err)
		resp.Body.Close()
		require.Equal(t, http.StatusOK, resp.StatusCode, path)
	}
	mailTo := func(addr string) int {
		req, err := http.NewRequest(http.MethodPost, srv.URL+"/send", strings.NewReader(`{"email":"`+addr+`","order_id":"o"}`))
		require.NoError(t, err)
		req.Header.Set("Idempotency-Key", "k-"+addr)
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		resp.Body.Close()
		return resp.StatusCode
	}
	require.Equal(t, http.StatusUnprocessableEntity, mailTo("a@bounce.example"))
	post("/bounces/off")
	require.Equal(t, http.StatusOK, mailTo("b@bounce.example"))
	post("/bounces/on")
	require.Equal(t, http.StatusUnprocessableEntity, mailTo("c@bounce.example"))
}
