package web_test

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/url"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"golang.org/x/crypto/bcrypt"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/inspect"
	"github.com/keeljobs/keel/internal/jobstore"
	"github.com/keeljobs/keel/internal/testenv"
	"github.com/keeljobs/keel/tasks"
	"github.com/keeljobs/keel/web"
)

// Passwords of the test users; hashed at the lowest cost to keep tests fast.
const (
	operatorName, operatorPassword = "olga", "operator-password"
	viewerName, viewerPassword     = "vic", "viewer-password"
)

var hashes = sync.OnceValue(func() map[string][]byte {
	h := map[string][]byte{}
	for _, pw := range []string{operatorPassword, viewerPassword} {
		b, err := bcrypt.GenerateFromPassword([]byte(pw), bcrypt.MinCost)
		if err != nil {
			panic(err)
		}
		h[pw] = b
	}
	return h
})

func testUsers() []web.User {
	return []web.User{
		{Name: operatorName, Role: web.RoleOperator, PasswordHash: hashes()[operatorPassword]},
		{Name: viewerName, Role: web.RoleViewer, PasswordHash: hashes()[viewerPassword]},
	}
}

type bundle struct {
	pool   *pgxpool.Pool
	redis  asynq.RedisClientOpt
	client *tasks.Client
	store  *jobstore.Store
	ops    *inspect.Inspector
	srv    *web.Server
	ts     *httptest.Server
	cfg    web.Config
}

// testKinds are the kinds the dashboard under test declares.
var testKinds = tasks.NewKinds(plainKind, panickySummary, bidiKind)

// setup gives the test a dashboard on a ledger schema and a Redis of its
// own, and runs it in parallel with the package's other tests.
func setup(t *testing.T, mod func(*web.Config)) *bundle {
	t.Helper()
	t.Parallel()
	return setupAlone(t, mod)
}

// setupAlone is setup for a test that drives a browser (CPU-heavy) or sets
// a package variable: it runs before the parallel ones, not beside them.
func setupAlone(t *testing.T, mod func(*web.Config)) *bundle {
	t.Helper()
	b := &bundle{redis: asynq.RedisClientOpt{Addr: testenv.StartRedis(t).Addr()}}
	b.pool, _ = testenv.PrivatePool(t)
	c, err := tasks.NewClient(tasks.ClientConfig{Redis: b.redis, Pool: b.pool})
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	b.client, b.store, b.ops = c, jobstore.NewStore(c.Pool()), c.Inspector()
	cfg := web.Config{
		Addr:           "127.0.0.1:0",
		Redis:          b.redis,
		Pool:           b.pool,
		Users:          testUsers(),
		Secret:         []byte(strings.Repeat("s", web.MinSecretBytes)),
		SampleInterval: time.Second,
		Logger:         slog.New(slog.DiscardHandler),
		Kinds:          testKinds,
	}
	if mod != nil {
		mod(&cfg)
	}
	b.cfg = cfg
	b.srv, err = web.New(cfg)
	require.NoError(t, err)
	t.Cleanup(b.srv.Close)
	b.ts = httptest.NewServer(b.srv.Handler())
	t.Cleanup(b.ts.Close)
	return b
}

// replica starts another server with the same settings, as a second
// replica (or the same one restarted) would run, and returns a bundle
// whose users talk to it.
func (b *bundle) replica(t *testing.T) *bundle {
	t.Helper()
	r := *b
	var err error
	r.srv, err = web.New(b.cfg)
	require.NoError(t, err)
	t.Cleanup(r.srv.Close)
	r.ts = httptest.NewServer(r.srv.Handler())
	t.Cleanup(r.ts.Close)
	return &r
}

// deadJob enqueues a job and marks it dead as a worker would.
func (b *bundle) deadJob(t *testing.T, kind, key, lastError string) idempotency.Job {
	t.Helper()
	res, err := b.client.Enqueue(context.Background(), tasks.NewRaw(kind, []byte(`{"order":"`+key+`"}`), key))
	require.NoError(t, err)
	_, err = b.pool.Exec(context.Background(), `UPDATE keel_jobs SET status = 'dead', attempts = 3, last_error = $2,
		error_class = 'permanent', finished_at = now(), payload_summary = $3, trace_id = 'trace-'||$4 WHERE id = $1`,
		res.Job.ID, lastError, "summary of "+key, key)
	require.NoError(t, err)
	j, err := b.store.Get(context.Background(), res.Job.ID)
	require.NoError(t, err)
	return j
}

// user is a browser-like client: a cookie jar, no redirects followed, and
// the server's own Origin on state-changing requests.
type user struct {
	b      *bundle
	c      *http.Client
	origin string
}

func (b *bundle) anonymous() *user {
	jar, _ := cookiejar.New(nil)
	// The server's own transport: http.DefaultTransport is shared by the
	// package's parallel tests, and each test server's Close closes its idle
	// connections, breaking a request of another test that was just taking
	// one ("CloseIdleConnections called").
	return &user{b: b, origin: b.ts.URL, c: &http.Client{Transport: b.ts.Client().Transport, Jar: jar, Timeout: 10 * time.Second,
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}}
}

func (b *bundle) signIn(t *testing.T, name, password string) *user {
	t.Helper()
	u := b.anonymous()
	res := u.post(t, "/login", url.Values{"name": {name}, "password": {password}})
	require.Equal(t, http.StatusSeeOther, res.status, res.body)
	return u
}

type response struct {
	status int
	header http.Header
	body   string
}

func (u *user) do(t *testing.T, method, path string, body io.Reader, hdr map[string]string) response {
	t.Helper()
	req, err := http.NewRequest(method, u.b.ts.URL+path, body)
	require.NoError(t, err)
	if method != http.MethodGet && method != http.MethodHead {
		req.Header.Set("Origin", u.origin)
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	}
	req.Header.Set("Accept", "text/html")
	for k, v := range hdr {
		if v == "" {
			req.Header.Del(k)
		} else {
			req.Header.Set(k, v)
		}
	}
	res, err := u.c.Do(req)
	require.NoError(t, err)
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	require.NoError(t, err)
	return response{status: res.StatusCode, header: res.Header, body: string(b)}
}

func (u *user) get(t *testing.T, path string) response {
	t.Helper()
	return u.do(t, http.MethodGet, path, nil, nil)
}

func (u *user) post(t *testing.T, path string, form url.Values) response {
	t.Helper()
	return u.do(t, http.MethodPost, path, strings.NewReader(form.Encode()), nil)
}

var csrfField = regexp.MustCompile(`name="csrf" value="([^"]+)"`)

// token reads the form token from a page the user can see.
func (u *user) token(t *testing.T) string {
	t.Helper()
	res := u.get(t, "/")
	require.Equal(t, http.StatusOK, res.status)
	m := csrfField.FindStringSubmatch(res.body)
	require.NotNil(t, m, "no form token on the overview")
	return m[1]
}

func (b *bundle) audit(t *testing.T, id string) []inspect.AuditEntry {
	t.Helper()
	es, err := b.ops.Audit(context.Background(), id)
	require.NoError(t, err)
	return es
}
