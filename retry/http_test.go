package retry

import (
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// serverDate is the Date every test response carries, so that an HTTP-date
// Retry-After has an exact meaning.
var serverDate = time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)

func TestFromResponse(t *testing.T) {
	t.Parallel()

	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		status, _ := strconv.Atoi(r.URL.Query().Get("status"))
		w.Header().Set("Date", serverDate.Format(http.TimeFormat))
		if ra := r.URL.Query().Get("retry_after"); ra != "" {
			w.Header().Set("Retry-After", ra)
		}
		if status == http.StatusFound {
			w.Header().Set("Location", "/elsewhere")
		}
		w.WriteHeader(status)
		_, _ = io.WriteString(w, "  status "+strconv.Itoa(status)+"\n")
	}))
	t.Cleanup(srv.Close)
	client := srv.Client()
	client.CheckRedirect = func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }

	date := func(d time.Duration) string { return serverDate.Add(d).Format(http.TimeFormat) }
	tests := []struct {
		status     int
		retryAfter string
		want       Class // empty: no error
		wantAfter  time.Duration
	}{
		{status: 200},
		{status: 204},
		{status: 302},
		{status: 304},
		{status: 400, want: ClassPermanent},
		{status: 401, want: ClassPermanent},
		{status: 403, want: ClassPermanent},
		{status: 404, want: ClassPermanent},
		{status: 409, want: ClassPermanent},
		{status: 422, want: ClassPermanent},
		{status: 400, retryAfter: "60", want: ClassPermanent}, // Retry-After does not make a 4xx retryable
		{status: 408, want: ClassTransient},
		{status: 425, want: ClassTransient},
		{status: 429, want: ClassTransient},
		{status: 500, want: ClassTransient},
		{status: 502, want: ClassTransient},
		{status: 503, want: ClassTransient},
		{status: 504, want: ClassTransient},
		{status: 429, retryAfter: "120", want: ClassWait, wantAfter: 2 * time.Minute},
		{status: 503, retryAfter: date(90 * time.Second), want: ClassWait, wantAfter: 90 * time.Second},
		{status: 429, retryAfter: "86400", want: ClassWait, wantAfter: MaxRetryAfter},
		{status: 503, retryAfter: date(48 * time.Hour), want: ClassWait, wantAfter: MaxRetryAfter},
		{status: 503, retryAfter: date(-time.Minute), want: ClassTransient},
		{status: 503, retryAfter: "0", want: ClassTransient},
		{status: 503, retryAfter: "-5", want: ClassTransient},
		{status: 503, retryAfter: "soon", want: ClassTransient},
	}
	for _, tt := range tests {
		t.Run(strconv.Itoa(tt.status)+"/"+tt.retryAfter, func(t *testing.T) {
			t.Parallel()
			q := url.Values{"status": {strconv.Itoa(tt.status)}, "retry_after": {tt.retryAfter}}
			req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, srv.URL+"/v1/charge?"+q.Encode(), nil)
			require.NoError(t, err)
			resp, err := client.Do(req)
			require.NoError(t, err)
			defer resp.Body.Close()

			err = FromResponse(resp)
			if tt.want == "" {
				require.NoError(t, err)
				return
			}
			require.Error(t, err)
			require.Equal(t, tt.want, Classify(err))
			e, ok := Marked(err)
			require.True(t, ok)
			require.Equal(t, tt.wantAfter, e.Delay)

			var httpErr *HTTPError
			require.ErrorAs(t, err, &httpErr)
			require.Equal(t, tt.status, httpErr.StatusCode)
			require.Equal(t, tt.wantAfter, httpErr.RetryAfter)
			require.Equal(t, http.MethodPost, httpErr.Method)
			require.Equal(t, srv.URL+"/v1/charge", httpErr.URL)
			require.Equal(t, "status "+strconv.Itoa(tt.status), httpErr.Body)
			require.Equal(t, "POST "+srv.URL+"/v1/charge: "+strconv.Itoa(tt.status)+" "+
				http.StatusText(tt.status)+": status "+strconv.Itoa(tt.status), err.Error())
		})
	}
}

func TestFromResponseBody(t *testing.T) {
	t.Parallel()

	body := "x" + strings.Repeat("é", 400) // the cut at 512 bytes splits an é
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusInternalServerError)
		_, _ = io.WriteString(w, body)
	}))
	t.Cleanup(srv.Close)

	resp, err := srv.Client().Get(srv.URL + "/hook?token=secret")
	require.NoError(t, err)
	defer resp.Body.Close()

	err = FromResponse(resp)
	var httpErr *HTTPError
	require.ErrorAs(t, err, &httpErr)
	require.Equal(t, "x"+strings.Repeat("é", 255), httpErr.Body, "cut at 512 bytes without a broken rune")
	require.NotContains(t, err.Error(), "secret")

	rest, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	require.Equal(t, body, string(rest), "the caller still reads the whole body")
}

func TestFromResponseRedactsURL(t *testing.T) {
	t.Parallel()

	req := httptest.NewRequest(http.MethodGet, "https://keel:hunter2@api.example.com/v1/x?api_key=secret#frag", nil)
	err := FromResponse(&http.Response{StatusCode: 404, Request: req, Body: http.NoBody})
	require.EqualError(t, err, "GET https://keel:xxxxx@api.example.com/v1/x: 404 Not Found")
	require.Nil(t, FromResponse(nil))
}

func TestParseRetryAfter(t *testing.T) {
	t.Parallel()

	now := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	tests := []struct {
		header http.Header
		want   time.Duration
	}{
		{header: http.Header{}, want: 0},
		{header: http.Header{"Retry-After": {" 30 "}}, want: 30 * time.Second},
		{header: http.Header{"Retry-After": {now.Add(time.Minute).Format(http.TimeFormat)}}, want: time.Minute},
		// RFC 850 and asctime dates are still valid HTTP-dates.
		{header: http.Header{"Retry-After": {now.Add(time.Minute).Format(time.RFC850)}}, want: time.Minute},
		{header: http.Header{"Retry-After": {now.Add(time.Minute).Format(time.ANSIC)}}, want: time.Minute},
		// The response's Date, not the local clock, is the reference.
		{header: http.Header{
			"Retry-After": {now.Add(time.Hour).Format(http.TimeFormat)},
			"Date":        {now.Add(59 * time.Minute).Format(http.TimeFormat)},
		}, want: time.Minute},
		{header: http.Header{"Retry-After": {"99999999999999999999"}}, want: MaxRetryAfter},
		{header: http.Header{"Retry-After": {"1.5"}}, want: 0},
	}
	for _, tt := range tests {
		require.Equal(t, tt.want, parseRetryAfter(tt.header, now), "%v", tt.header)
	}
}

func TestHTTPErrorIsPlainError(t *testing.T) {
	t.Parallel()

	err := &HTTPError{StatusCode: 502}
	require.EqualError(t, err, "502 Bad Gateway")
	require.True(t, errors.Is(Transient(err), ErrTransient))
}
