package executor

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptrace"
	"sync"

	"github.com/keeljobs/keel/retry"
)

// HeaderIdempotencyKey is idempotency.HeaderIdempotencyKey.
const HeaderIdempotencyKey = "Idempotency-Key"

// ErrResent is idempotency.ErrResent.
var ErrResent = errors.New("request sent more than once by the HTTP client")

// StepHTTP is idempotency.StepHTTP.
func StepHTTP(ctx context.Context, name string, client *http.Client, newReq func(ctx context.Context, key string) (*http.Request, error), opts ...StepOption) error {
	return Step(ctx, name, func(ctx context.Context, key string) error {
		req, err := newReq(ctx, key)
		if err != nil {
			return NotSent(err)
		}
		resp, err := DoHTTP(client, req, key)
		if err != nil {
			return err
		}
		// The call is done whatever happens to the rest of the body.
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
		_ = resp.Body.Close()
		return nil
	}, opts...)
}

// DoHTTP is idempotency.DoHTTP.
func DoHTTP(client *http.Client, req *http.Request, key string) (*http.Response, error) {
	if client == nil {
		client = http.DefaultClient
	}
	var t sendTrace
	req = req.Clone(httptrace.WithClientTrace(req.Context(), t.hooks()))
	if req.Header == nil {
		req.Header = http.Header{}
	}
	req.Header.Set(HeaderIdempotencyKey, key)
	req.GetBody = nil
	if req.Body == nil || req.Body == http.NoBody {
		req.Body = onceBody{http.NoBody}
	} else {
		req.Body = onceBody{req.Body}
	}

	resp, err := client.Do(req)
	st := t.state()
	// A followed redirect writes a request of its own, and the hooks may
	// report the first write after its answer began: not a resend.
	if st.resent && (resp == nil || !followed(req, resp)) {
		if resp != nil {
			resp.Body.Close()
		}
		return nil, retry.Permanent(doubt("", fmt.Errorf("%s %s: %w", req.Method, redactedURL(req), ErrResent)))
	}
	if err != nil {
		if st.answered || st.wrote || !st.neverLeft(tracedTransport(client)) {
			// The other side may have the whole request; what it did with
			// it is unknown.
			return nil, doubt("sent, no answer", err)
		}
		return nil, NotSent(err)
	}
	if resp.StatusCode == http.StatusTemporaryRedirect || resp.StatusCode == http.StatusPermanentRedirect {
		resp.Body.Close()
		return nil, retry.Permanent(fmt.Errorf("%s %s: %d redirect to %q not followed: a step's request is sent once, send it to the final URL",
			req.Method, redactedURL(req), resp.StatusCode, resp.Header.Get("Location")))
	}
	if ferr := retry.FromResponse(resp); ferr != nil {
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
		resp.Body.Close()
		if followed(req, resp) {
			// The client followed a 301, 302 or 303: the request itself was
			// answered with the redirect (a 303 after a POST: done, the
			// result is elsewhere), and this failure is its target's.
			return nil, doubt(fmt.Sprintf("answered with a redirect to %s, which then failed", redactedURL(resp.Request)), ferr)
		}
		if he := (*retry.HTTPError)(nil); errors.As(ferr, &he) && answerInDoubt(he) {
			return nil, doubt("a server error, which may come after the effect", ferr)
		}
		return nil, ferr
	}
	return resp, nil
}

// followed tells whether resp answers a request the client made by
// following a redirect: http.Client sets such a request's Response to the
// redirect that caused it (a transport rewriting the URL does not).
func followed(_ *http.Request, resp *http.Response) bool {
	return resp.Request != nil && resp.Request.Response != nil
}

func redactedURL(req *http.Request) string {
	if req.URL == nil {
		return ""
	}
	u := *req.URL
	u.RawQuery, u.ForceQuery, u.Fragment, u.RawFragment = "", false, "", ""
	return u.Redacted()
}

// onceBody hides a request body's type from the transport, which only
// replays bodies it can rewind. Its Close never fails: a close error after
// the body was written would otherwise read as a failed write.
type onceBody struct{ io.ReadCloser }

func (b onceBody) Close() error {
	_ = b.ReadCloser.Close()
	return nil
}

// sendTrace records what happened to one request on the wire. Its hooks
// may run on the transport's goroutines, after Do has returned.
type sendTrace struct {
	mu sync.Mutex
	s  sendState
	// pending: a request was written and no response has begun since.
	pending bool
}

type sendState struct {
	getConn     bool // the transport looked for a connection
	gotConn     bool // a connection was obtained
	wrote       bool // a request was written completely
	writeFailed bool // writing a request failed part-way
	answered    bool // a response began to arrive
	resent      bool // a request was written again before any response
}

// neverLeft reports whether a request that was neither written completely
// nor answered certainly did not reach the other side: the transport found
// no connection, or an http.Transport refused it before looking for one. A
// write that failed part-way proves nothing — the bytes the other side needed
// may all have left before the error (a body longer than its
// Content-Length fails only after the declared bytes were sent) — and
// neither does a transport that reports nothing through httptrace.
func (s sendState) neverLeft(traced bool) bool {
	switch {
	case s.writeFailed:
		return false
	case s.getConn:
		return !s.gotConn
	default:
		return traced
	}
}

// tracedTransport reports whether client sends through an http.Transport,
// which reports every connection it looks for to httptrace.
func tracedTransport(client *http.Client) bool {
	rt := client.Transport
	if rt == nil {
		rt = http.DefaultTransport
	}
	_, ok := rt.(*http.Transport)
	return ok
}

func (t *sendTrace) hooks() *httptrace.ClientTrace {
	return &httptrace.ClientTrace{
		GetConn: func(string) {
			t.mu.Lock()
			t.s.getConn = true
			t.mu.Unlock()
		},
		GotConn: func(httptrace.GotConnInfo) {
			t.mu.Lock()
			t.s.gotConn = true
			t.mu.Unlock()
		},
		WroteRequest: func(info httptrace.WroteRequestInfo) {
			t.mu.Lock()
			defer t.mu.Unlock()
			if info.Err != nil {
				t.s.writeFailed = true
				return
			}
			if t.pending {
				t.s.resent = true
			}
			t.s.wrote, t.pending = true, true
		},
		GotFirstResponseByte: func() {
			t.mu.Lock()
			t.s.answered, t.pending = true, false
			t.mu.Unlock()
		},
	}
}

func (t *sendTrace) state() sendState {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.s
}
