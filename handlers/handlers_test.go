package handlers_test

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/handlers"
	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/jobstore"
	"github.com/keeljobs/keel/internal/testenv"
	"github.com/keeljobs/keel/internal/testworker"
	"github.com/keeljobs/keel/keeltest"
	"github.com/keeljobs/keel/retry"
	"github.com/keeljobs/keel/tasks"
)

type app struct {
	h       *keeltest.Harness
	api     *httptest.Server
	mail    *handlers.MailSim
	mailURL string
	mux     func() // starts the worker
}

// newApp gives the test a Redis of its own beside the harness's own
// schema, and runs it in parallel with the package's other tests.
func newApp(t *testing.T, faults handlers.Faults) *app {
	t.Helper()
	t.Parallel()
	h := keeltest.New(t, keeltest.Options{RedisAddr: testenv.StartRedis(t).Addr()})
	require.NoError(t, handlers.Migrate(context.Background(), h.Pool))
	a := &app{h: h, mail: handlers.NewMailSim(faults, 1)}
	mailSrv := httptest.NewServer(a.mail)
	t.Cleanup(mailSrv.Close)
	a.mailURL = mailSrv.URL
	api := &handlers.API{Pool: h.Pool, Client: h.Client}
	a.api = httptest.NewServer(api.Handler())
	t.Cleanup(a.api.Close)
	a.mux = func() {
		m := tasksMux(h, mailSrv.URL)
		h.Worker(t, m)
	}
	return a
}

func (a *app) post(t *testing.T, key string, req handlers.OrderRequest) (int, handlers.OrderResponse) {
	t.Helper()
	body, _ := json.Marshal(req)
	r, err := http.NewRequest(http.MethodPost, a.api.URL+"/orders", bytes.NewReader(body))
	require.NoError(t, err)
	if key != "" {
		r.Header.Set("Idempotency-Key", key)
	}
	resp, err := http.DefaultClient.Do(r)
	require.NoError(t, err)
	defer resp.Body.Close()
	var out handlers.OrderResponse
	_ = json.NewDecoder(resp.Body).Decode(&out)
	return resp.StatusCode, out
}

func TestCreateOrderEnqueuesItsJobsOnce(t *testing.T) {
	a := newApp(t, handlers.Faults{})
	code, first := a.post(t, "k1", handlers.OrderRequest{Email: "a@example.com", Amount: 10})
	require.Equal(t, http.StatusCreated, code)
	code, again := a.post(t, "k1", handlers.OrderRequest{Email: "a@example.com", Amount: 10})
	require.Equal(t, http.StatusOK, code)
	require.True(t, again.Duplicate)
	require.Equal(t, first.ID, again.ID)
	for _, kind := range []string{"order:send_receipt", "order:generate_invoice", "analytics:sync"} {
		j := keeltest.Enqueued(t, a.h.Pool, kind, "order:"+first.ID)
		require.Equal(t, idempotency.StatusPending, j.Status)
	}
	var n int
	require.NoError(t, a.h.Pool.QueryRow(context.Background(), `SELECT count(*) FROM keel_jobs`).Scan(&n))
	require.Equal(t, 3, n, "a duplicate submission enqueued more jobs")
	// The key again with another order: not a retry of the first, and not
	// silently answered as if it were.
	code, _ = a.post(t, "k1", handlers.OrderRequest{Email: "b@example.com", Amount: 99})
	require.Equal(t, http.StatusUnprocessableEntity, code)
	require.NoError(t, a.h.Pool.QueryRow(context.Background(), `SELECT count(*) FROM keel_jobs`).Scan(&n))
	require.Equal(t, 3, n)

	for _, bad := range []struct {
		key  string
		body handlers.OrderRequest
		want int
	}{
		{"", handlers.OrderRequest{Email: "a@example.com", Amount: 1}, http.StatusBadRequest},
		{"k2", handlers.OrderRequest{Email: "nope", Amount: 1}, http.StatusUnprocessableEntity},
		{"k3", handlers.OrderRequest{Email: "a@example.com", Amount: 0}, http.StatusUnprocessableEntity},
	} {
		code, _ := a.post(t, bad.key, bad.body)
		require.Equal(t, bad.want, code)
	}
}

// What is enqueued in a transaction is visible in it, and gone with a
// rollback.
func TestEnqueuedInTransaction(t *testing.T) {
	a := newApp(t, handlers.Faults{})
	ctx := context.Background()
	tx, err := a.h.Pool.Begin(ctx)
	require.NoError(t, err)
	_, err = a.h.Client.EnqueueTx(ctx, tx, handlers.GenerateInvoice.New(handlers.Invoice{OrderID: "tx1"}))
	require.NoError(t, err)
	keeltest.Enqueued(t, tx, handlers.GenerateInvoice.Name(), "order:tx1")
	keeltest.NotEnqueued(t, a.h.Pool, handlers.GenerateInvoice.Name(), "order:tx1") // not committed yet
	require.NoError(t, tx.Rollback(ctx))
	keeltest.NotEnqueued(t, a.h.Pool, handlers.GenerateInvoice.Name(), "order:tx1")
}

func TestOrderJobsCompleteWithEffectsOnce(t *testing.T) {
	// Lost replies: the mail goes out but the caller never hears so; the
	// next attempt asks the service, which does not dedupe, instead of
	// sending again.
	a := newApp(t, handlers.Faults{LostReplies: 0.5})
	_, o := a.post(t, "order-1", handlers.OrderRequest{Email: "b@example.com", Amount: 99})
	a.mux()
	for _, kind := range []string{"order:send_receipt", "order:generate_invoice", "analytics:sync"} {
		j := keeltest.Enqueued(t, a.h.Pool, kind, "order:"+o.ID)
		j = a.h.Wait(t, j.ID, 30*time.Second, idempotency.StatusSucceeded)
		// A duplicate delivery afterwards changes nothing.
		a.h.Redeliver(t, j.ID)
	}
	a.h.Drain(t, 20*time.Second) // the redeliveries have run
	receipt := keeltest.Enqueued(t, a.h.Pool, "order:send_receipt", "order:"+o.ID)
	steps, err := a.h.Client.Inspector().Steps(context.Background(), receipt.ID)
	require.NoError(t, err)
	require.Len(t, steps, 1)
	require.Equal(t, "done", steps[0].Status)

	resp, err := http.Get(a.api.URL + "/orders/" + o.ID)
	require.NoError(t, err)
	var got handlers.OrderResponse
	require.NoError(t, json.NewDecoder(resp.Body).Decode(&got))
	resp.Body.Close()
	require.Len(t, got.Jobs, 3)
	for _, j := range got.Jobs {
		require.Equal(t, "succeeded", j.Status, j.Kind)
	}
	var invoices int
	require.NoError(t, a.h.Pool.QueryRow(context.Background(), `SELECT count(*) FROM keel_example_invoices WHERE order_id = $1`, o.ID).Scan(&invoices))
	require.Equal(t, 1, invoices)
	st := a.mail.Stats()
	require.Equal(t, 1, st.Mails)
	require.Equal(t, 0, st.OrdersMailedTwice)
}

func TestBouncingAddressDiesAtOnce(t *testing.T) {
	a := newApp(t, handlers.Faults{BounceDomain: "bounce.example"})
	_, o := a.post(t, "bounce", handlers.OrderRequest{Email: "x@bounce.example", Amount: 5})
	a.mux()
	j := keeltest.Enqueued(t, a.h.Pool, "order:send_receipt", "order:"+o.ID)
	j = a.h.Wait(t, j.ID, 30*time.Second, idempotency.StatusDead, idempotency.StatusSucceeded)
	require.Equal(t, idempotency.StatusDead, j.Status)
	require.Equal(t, 1, j.Attempts)
	require.Equal(t, string(retry.ClassPermanent), j.ErrorClass)
	require.Contains(t, j.LastError, "422")
	require.Equal(t, "order "+o.ID+" (email redacted)", j.PayloadSummary, "the email must not reach the dead letters")
}

func TestReceiptRetriesThroughServerErrors(t *testing.T) {
	a := newApp(t, handlers.Faults{ServerErrors: 1})
	_, o := a.post(t, "flaky", handlers.OrderRequest{Email: "c@example.com", Amount: 5})
	a.mux()
	j := keeltest.Enqueued(t, a.h.Pool, "order:send_receipt", "order:"+o.ID)
	testenv.Eventually(t, 20*time.Second, func() bool {
		j, _ = a.h.Client.Inspector().Get(context.Background(), j.ID)
		return j.Attempts >= 2
	}, "the receipt was not retried")
	require.Equal(t, string(retry.ClassTransient), j.ErrorClass)
	a.mail.SetFaults(handlers.Faults{})
	a.h.Wait(t, j.ID, 30*time.Second, idempotency.StatusSucceeded)
	require.Equal(t, 1, a.mail.Stats().Mails)
}

// The tour's replay: a receipt dead because its mailbox bounced succeeds
// when replayed after the mailbox is fixed.
func TestReplayAfterTheMailboxIsFixed(t *testing.T) {
	a := newApp(t, handlers.Faults{BounceDomain: "bounce.example"})
	_, o := a.post(t, "fix-me", handlers.OrderRequest{Email: "y@bounce.example", Amount: 5})
	a.mux()
	j := keeltest.Enqueued(t, a.h.Pool, "order:send_receipt", "order:"+o.ID)
	a.h.Wait(t, j.ID, 30*time.Second, idempotency.StatusDead)

	mailURL := a.mailURL
	resp, err := http.Post(mailURL+"/bounces/off", "", nil)
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)

	_, err = testworker.Ops(t, jobstore.NewStore(a.h.Pool), nil).Replay(context.Background(), j.ID, "test", "mailbox fixed")
	require.NoError(t, err)
	a.h.Wait(t, j.ID, 30*time.Second, idempotency.StatusSucceeded)
	require.Equal(t, 1, a.mail.Stats().Mails)
}

// The mail service cuts every connection after sending: the caller cannot
// tell, so the next attempt asks the service (the step's Verify) and does
// not send again. The service does not dedupe: one mail proves keel sent once.
func TestLostReplyIsVerifiedNotResent(t *testing.T) {
	a := newApp(t, handlers.Faults{LostReplies: 1})
	_, o := a.post(t, "lost", handlers.OrderRequest{Email: "d@example.com", Amount: 5})
	a.mux()
	j := keeltest.Enqueued(t, a.h.Pool, "order:send_receipt", "order:"+o.ID)
	j = a.h.Wait(t, j.ID, 30*time.Second, idempotency.StatusSucceeded)
	require.Equal(t, 2, j.Attempts, "the second attempt settles the doubt")
	st := a.mail.Stats()
	require.Equal(t, 1, st.Calls, "a send in doubt was repeated")
	require.Equal(t, 1, st.Mails)
	require.Equal(t, 0, st.OrdersMailedTwice)
}

// The mail goes out but its reply comes after the client's timeout: a
// timeout after sending is in doubt, verified, and not sent again.
func TestTimeoutAfterSendIsVerifiedNotResent(t *testing.T) {
	a := newApp(t, handlers.Faults{Slow: 1, SlowFor: time.Minute})
	_, o := a.post(t, "slow", handlers.OrderRequest{Email: "e@example.com", Amount: 5})
	a.mux()
	j := keeltest.Enqueued(t, a.h.Pool, "order:send_receipt", "order:"+o.ID)
	a.h.Wait(t, j.ID, 30*time.Second, idempotency.StatusSucceeded)
	st := a.mail.Stats()
	require.Equal(t, 1, st.Calls, "a send that timed out after leaving was repeated")
	require.Equal(t, 1, st.Mails)
	require.Equal(t, 0, st.OrdersMailedTwice)
}

// The daily report stores its totals as the job's result, committed with
// the report in its completing InTx.
func TestDailyReportStoresItsTotals(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	h := keeltest.New(t, keeltest.Options{RedisAddr: testenv.StartRedis(t).Addr(),
		Queues: map[string]int{"default": 1, handlers.ReportsQueue: 1}})
	require.NoError(t, handlers.Migrate(ctx, h.Pool))
	_, err := h.Pool.Exec(ctx, `INSERT INTO keel_example_orders (id, email, amount) VALUES ('o1', 'a@example.com', 40), ('o2', 'b@example.com', 2)`)
	require.NoError(t, err)
	h.Worker(t, tasksMux(h, "http://127.0.0.1:1"))
	var day string // the orders' (UTC) day, however close to midnight the test runs
	require.NoError(t, h.Pool.QueryRow(ctx, `SELECT to_char(min(created_at) AT TIME ZONE 'UTC', 'YYYY-MM-DD') FROM keel_example_orders`).Scan(&day))
	res, err := h.Client.Enqueue(ctx, handlers.GenerateDailyReport.New(handlers.DailyReport{Day: day}))
	require.NoError(t, err)
	h.Wait(t, res.Job.ID, 30*time.Second, idempotency.StatusSucceeded)
	totals, err := tasks.ResultAs[handlers.ReportTotals](h.Client.Result(ctx, res.Job.ID))
	require.NoError(t, err)
	require.Equal(t, handlers.ReportTotals{Day: day, Orders: 2, Revenue: 42}, totals)
}
