package retry

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"
)

const (
	// MaxRetryAfter bounds the Retry-After a server can impose: a larger
	// value is more likely a mistake than a plan.
	MaxRetryAfter = time.Hour
	// maxBody is how much of an error response is kept for the message.
	maxBody = 512
)

// HTTPError is a response whose status says the call failed.
type HTTPError struct {
	StatusCode int
	// RetryAfter is the server's Retry-After, capped at MaxRetryAfter; zero
	// when absent or already past.
	RetryAfter time.Duration
	// Body is the start of the response body (at most 512 bytes).
	Body   string
	Method string
	// URL is the request's URL without query, fragment or password, which
	// often carry secrets and end up in dead letters and logs.
	URL string
}

func (e *HTTPError) Error() string {
	var b strings.Builder
	if e.Method != "" || e.URL != "" {
		b.WriteString(strings.TrimSpace(e.Method + " " + e.URL))
		b.WriteString(": ")
	}
	fmt.Fprintf(&b, "%d %s", e.StatusCode, http.StatusText(e.StatusCode))
	if e.Body != "" {
		b.WriteString(": ")
		b.WriteString(e.Body)
	}
	return b.String()
}

// FromResponse turns a failed response into a marked *HTTPError: a 429 or
// 503 with Retry-After is a Wait (no attempt used; the job's wait ceiling
// bounds it); 408, 425, 429 and 5xx are otherwise transient (After, when the
// server sent Retry-After); any other 4xx is permanent. It returns nil for a nil response and for statuses
// below 400.
//
// The start of the body is read for the message and put back: the caller
// can still read the whole body and must still close it.
func FromResponse(resp *http.Response) error {
	if resp == nil || resp.StatusCode < 400 {
		return nil
	}
	e := &HTTPError{StatusCode: resp.StatusCode}
	if req := resp.Request; req != nil {
		e.Method = req.Method
		if req.URL != nil {
			u := *req.URL
			u.RawQuery, u.ForceQuery, u.Fragment, u.RawFragment = "", false, "", ""
			e.URL = u.Redacted()
		}
	}
	if resp.Body != nil && resp.Body != http.NoBody {
		head, _ := io.ReadAll(io.LimitReader(resp.Body, maxBody))
		resp.Body = struct {
			io.Reader
			io.Closer
		}{io.MultiReader(bytes.NewReader(head), resp.Body), resp.Body}
		e.Body = bodyText(head)
	}
	if statusClass(resp.StatusCode) == ClassPermanent {
		return Permanent(e)
	}
	e.RetryAfter = parseRetryAfter(resp.Header, time.Now())
	if e.RetryAfter > 0 {
		if resp.StatusCode == http.StatusTooManyRequests || resp.StatusCode == http.StatusServiceUnavailable {
			// The other side is fine and told us when to come back: a wait,
			// which uses up no attempt (its total has a ceiling instead).
			return Wait(e.RetryAfter, e)
		}
		return After(e.RetryAfter, e)
	}
	return Transient(e)
}

// statusClass classifies a failed status. 425 Too Early is transient because
// the same request succeeds once the handshake is done.
func statusClass(code int) Class {
	switch {
	case code == http.StatusRequestTimeout,
		code == http.StatusTooEarly,
		code == http.StatusTooManyRequests,
		code >= 500:
		return ClassTransient
	case code >= 400:
		return ClassPermanent
	}
	return ClassUnknown
}

// parseRetryAfter reads both forms of Retry-After. An HTTP date is measured
// from the response's own Date when it has one, so that a skewed local clock
// does not stretch or shrink the wait.
func parseRetryAfter(h http.Header, now time.Time) time.Duration {
	v := strings.TrimSpace(h.Get("Retry-After"))
	if v == "" {
		return 0
	}
	var d time.Duration
	if secs, err := strconv.ParseInt(v, 10, 64); err == nil || errors.Is(err, strconv.ErrRange) {
		// A range error's secs is the clamped value, which the cap handles.
		if secs <= 0 {
			return 0
		}
		if secs >= int64(MaxRetryAfter/time.Second) {
			return MaxRetryAfter
		}
		d = time.Duration(secs) * time.Second
	} else {
		at, err := http.ParseTime(v)
		if err != nil {
			return 0
		}
		if date, err := http.ParseTime(h.Get("Date")); err == nil {
			now = date
		}
		d = at.Sub(now)
	}
	return max(0, min(d, MaxRetryAfter))
}

func bodyText(b []byte) string {
	s := strings.TrimSpace(string(b))
	// The cut at maxBody may split a rune.
	if !utf8.ValidString(s) {
		s = strings.ToValidUTF8(s, "")
	}
	return s
}
