package web_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/inspect"
	"github.com/keeljobs/keel/web"
)

// deadMany makes n dead jobs of kind.
func (b *bundle) deadMany(t *testing.T, kind string, n int) {
	t.Helper()
	for i := range n {
		b.deadJob(t, kind, fmt.Sprintf("many:%d", i), "boom")
	}
}

// A bulk action can take longer than anyone waits for a page: an operator
// whose browser (or proxy) gives up once the form is sent must not leave it
// undone, or done part-way with the rest silently left; by filter or on
// selected jobs.
func TestBulkActionGoesOnWhenTheBrowserLeaves(t *testing.T) {
	for _, tc := range []struct {
		name string
		n    int
		form func(ids []string) url.Values
	}{
		// Many: the ledger's work is a statement per page of jobs, quick.
		{"by filter", 5000, func([]string) url.Values {
			return url.Values{"kind": {"order:send_receipt"}}
		}},
		{"selected", 1000, func(ids []string) url.Values { return url.Values{"id": ids} }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := setup(t, nil)
			rows, err := b.pool.Query(context.Background(), `INSERT INTO keel_jobs (id, kind, business_key, queue, payload, status,
				max_retry, error_class, last_error, finished_at) SELECT gen_random_uuid()::text, 'order:send_receipt', 'many:' || g,
				'default', '{}', 'dead', 3, 'permanent', 'boom', now() FROM generate_series(1, $1) g RETURNING id`, tc.n)
			require.NoError(t, err)
			ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
			require.NoError(t, err)
			op := b.signIn(t, operatorName, operatorPassword)
			form := tc.form(ids)
			form.Set("csrf", op.token(t))
			form.Set("action", "discard")
			form.Set("note", "cleanup")
			form.Set("expect", fmt.Sprint(tc.n))
			// The browser leaves as soon as the server has the form, and
			// the server goes on only once it has seen it leave: an action
			// tied to the request would then do nothing, or stop part-way.
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			web.SetBulkStartingHook(b.srv, func(request context.Context) {
				cancel()
				<-request.Done()
			})
			req, err := http.NewRequestWithContext(ctx, http.MethodPost, b.ts.URL+"/dead/bulk", strings.NewReader(form.Encode()))
			require.NoError(t, err)
			req.Header.Set("Origin", op.origin)
			req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
			res, err := op.c.Do(req)
			if err == nil {
				res.Body.Close()
				t.Fatalf("the request was answered (%d) after the browser left", res.StatusCode)
			}
			require.True(t, errors.Is(err, context.Canceled), "%v", err)
			deadline := time.Now().Add(60 * time.Second)
			for {
				left, err := b.ops.Count(context.Background(), inspect.Filter{Kind: "order:send_receipt"})
				require.NoError(t, err)
				if left == 0 {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("%d of %d jobs are still dead a minute after the browser left", left, tc.n)
				}
				time.Sleep(50 * time.Millisecond)
			}
			var discarded int
			require.NoError(t, b.pool.QueryRow(context.Background(),
				`SELECT count(*) FROM keel_jobs WHERE kind = 'order:send_receipt' AND status = 'discarded'`).Scan(&discarded))
			require.Equal(t, tc.n, discarded)
		})
	}
}

var bulkPage = regexp.MustCompile(`^/bulk/[0-9a-f]{32}$`)

// A bulk action still running when its request has waited long enough
// sends the operator to a page that shows its progress until it is done.
func TestLongBulkActionShowsItsProgress(t *testing.T) {
	b := setupAlone(t, nil)
	web.SetBulkInlineWait(t, 0)
	const n = 40
	b.deadMany(t, "order:send_receipt", n)
	op := b.signIn(t, operatorName, operatorPassword)
	res := op.post(t, "/dead/bulk", url.Values{"csrf": {op.token(t)}, "action": {"replay"}, "kind": {"order:send_receipt"},
		"expect": {fmt.Sprint(n)}})
	require.Equal(t, http.StatusSeeOther, res.status, res.body)
	where := res.header.Get("Location")
	require.Regexp(t, bulkPage, where)

	require.Equal(t, http.StatusFound, b.anonymous().get(t, where).status, "the progress page needs a signed-in user")
	deadline := time.Now().Add(60 * time.Second)
	for {
		page := op.get(t, where)
		require.Equal(t, http.StatusOK, page.status)
		if strings.Contains(page.body, fmt.Sprintf("Bulk replay: %d of %d done</h1>", n, n)) {
			require.NotContains(t, page.body, `http-equiv="refresh"`, "a finished action's page stays put")
			break
		}
		require.Contains(t, page.body, "done so far")
		require.Contains(t, page.body, `http-equiv="refresh"`)
		require.Contains(t, page.body, "Started by "+operatorName)
		if time.Now().After(deadline) {
			t.Fatalf("the bulk replay did not finish: %s", page.body)
		}
		time.Sleep(50 * time.Millisecond)
	}
	left, err := b.ops.Count(context.Background(), inspect.Filter{})
	require.NoError(t, err)
	require.Zero(t, left)
	require.Equal(t, http.StatusNotFound, op.get(t, "/bulk/0123456789abcdef0123456789abcdef").status)
}
