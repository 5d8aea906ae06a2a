package handlers

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/tasks"
)

// Receipt asks for an order's receipt to be mailed.
type Receipt struct {
	OrderID string `json:"order_id"`
	Email   string `json:"email"`
}

// Invoice asks for an order's invoice document to be built and stored.
type Invoice struct {
	OrderID string `json:"order_id"`
}

// Analytics asks for an order to be synced to the analytics system.
type Analytics struct {
	OrderID string `json:"order_id"`
}

// DailyReport asks for the report of one day (YYYY-MM-DD, UTC). The cron
// entry that enqueues it names the day, so one day is one report.
type DailyReport struct {
	Day string `json:"day"`
}

// ReportTotals is a daily report's result, stored with its job
// (idempotency.SetResult): a caller reads it with tasks.Client.Result, and
// the dashboard and `status` show it.
type ReportTotals struct {
	Day     string `json:"day"`
	Orders  int64  `json:"orders"`
	Revenue int64  `json:"revenue"`
}

// ReportsQueue is where long jobs go; run its workers apart:
// keel worker --queues reports:1 --concurrency 2.
const ReportsQueue = "reports"

// The example kinds. Each names its business action with a key, so a
// duplicate submission of the same order is the same job.
var (
	SendReceipt = tasks.Define[Receipt]("order:send_receipt",
		tasks.Queue("critical"), tasks.MaxRetry(8), tasks.Timeout(30*time.Second),
		tasks.Key(func(r Receipt) string { return "order:" + r.OrderID }),
		// Email addresses are personal data: keep them out of dead letters.
		tasks.Summary(func(r Receipt) string { return "order " + r.OrderID + " (email redacted)" }))
	GenerateInvoice = tasks.Define[Invoice]("order:generate_invoice",
		tasks.Queue("default"), tasks.Timeout(2*time.Minute),
		tasks.Key(func(i Invoice) string { return "order:" + i.OrderID }))
	SyncAnalytics = tasks.Define[Analytics]("analytics:sync",
		tasks.Queue("low"), tasks.MaxRetry(3),
		tasks.Key(func(a Analytics) string { return "order:" + a.OrderID }))
	// A long job: on a queue of its own, read by workers of its own, so a
	// slow report never holds the slots that receipts need.
	GenerateDailyReport = tasks.Define[DailyReport]("report:daily",
		tasks.Queue(ReportsQueue), tasks.Timeout(10*time.Minute),
		tasks.Key(func(r DailyReport) string { return "day:" + r.Day }))
)

// Kinds are the example service's kinds, for its worker, dashboard,
// scheduler and command line.
var Kinds = tasks.NewKinds(SendReceipt, GenerateInvoice, SyncAnalytics, GenerateDailyReport)

// Mailer sends mail. key is the send's idempotency key, to pass to the mail
// service. An error means the mail may have gone out unless it is marked
// idempotency.NotSent or is the service's answer (idempotency.DoHTTP marks
// both): the step then does not send again without asking MailVerifier.
type Mailer interface {
	SendReceipt(ctx context.Context, key, email, orderID string) error
}

// MailVerifier can tell whether a mail with a key went out. A Mailer that
// implements it lets a send in doubt (a lost reply, a timeout, a crash
// mid-call) be verified instead of parked for a person.
type MailVerifier interface {
	Sent(ctx context.Context, key string) (bool, error)
}

// LogMailer "sends" mail by logging it; the demo replaces it with a client of
// its simulated mail service.
type LogMailer struct{ Log *slog.Logger }

// SendReceipt logs the mail.
func (m LogMailer) SendReceipt(ctx context.Context, key, email, orderID string) error {
	m.Log.Info("mail sent", "idempotency_key", key, "order_id", orderID)
	return nil
}

// Deps are what the example handlers need.
type Deps struct {
	Pool   *pgxpool.Pool
	Mailer Mailer
}

// Register adds the example handlers to mux.
func Register(mux *tasks.Mux, d Deps) {
	if d.Mailer == nil {
		d.Mailer = LogMailer{Log: slog.Default()}
	}
	tasks.Handle(mux, SendReceipt, func(ctx context.Context, r Receipt) error {
		// External effect: a recorded step. A retry after the mail went out
		// skips it; a send that may have gone out (a lost reply, a timeout, a
		// crash mid-call) is verified or parked, never re-sent blindly. Steps
		// come first; a handler's completing InTx, if any, comes last.
		var opts []idempotency.StepOption
		if v, ok := d.Mailer.(MailVerifier); ok {
			opts = append(opts, idempotency.Verify(v.Sent))
		}
		return idempotency.Step(ctx, "mail", func(ctx context.Context, key string) error {
			return d.Mailer.SendReceipt(ctx, key, r.Email, r.OrderID)
		}, opts...)
	})
	tasks.Handle(mux, GenerateInvoice, func(ctx context.Context, inv Invoice) error {
		doc := fmt.Sprintf("INVOICE for order %s, generated %s", inv.OrderID, time.Now().UTC().Format(time.RFC3339))
		// Local effect: the document and the job's completion commit together.
		return idempotency.InTx(ctx, func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `INSERT INTO keel_example_invoices (order_id, document) VALUES ($1, $2)`, inv.OrderID, doc)
			return err
		})
	})
	tasks.Handle(mux, GenerateDailyReport, func(ctx context.Context, r DailyReport) error {
		day, err := time.Parse(time.DateOnly, r.Day)
		if err != nil {
			day = time.Now().UTC().Truncate(24 * time.Hour) // a cron tick names no day: report today
		}
		return idempotency.InTx(ctx, func(tx pgx.Tx) error {
			id, _ := idempotency.JobID(ctx)
			totals := ReportTotals{Day: day.Format(time.DateOnly)}
			err := tx.QueryRow(ctx, `INSERT INTO keel_example_reports (job_id, day, orders, revenue)
				SELECT $1, $2::date, count(*), coalesce(sum(amount), 0) FROM keel_example_orders
				WHERE created_at >= $2::date AND created_at < $2::date + 1
				RETURNING orders, revenue`, id, day).Scan(&totals.Orders, &totals.Revenue)
			if err != nil {
				return err
			}
			// Set inside the completing InTx: it commits with the report.
			return idempotency.SetResult(ctx, totals)
		})
	})
	tasks.Handle(mux, SyncAnalytics, func(ctx context.Context, a Analytics) error {
		return idempotency.InTx(ctx, func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `UPDATE keel_example_orders SET synced_at = now() WHERE id = $1`, a.OrderID)
			return err
		})
	})
}

// Migrate creates the example's own tables (not part of keel's ledger).
func Migrate(ctx context.Context, pool *pgxpool.Pool) error {
	_, err := pool.Exec(ctx, `
		CREATE TABLE IF NOT EXISTS keel_example_orders (
			id         text PRIMARY KEY,
			email      text NOT NULL,
			amount     bigint NOT NULL,
			created_at timestamptz NOT NULL DEFAULT now(),
			synced_at  timestamptz);
		CREATE TABLE IF NOT EXISTS keel_example_invoices (
			order_id   text PRIMARY KEY,
			document   text NOT NULL,
			created_at timestamptz NOT NULL DEFAULT now());
		CREATE TABLE IF NOT EXISTS keel_example_reports (
			job_id     text PRIMARY KEY,
			day        date NOT NULL,
			orders     bigint NOT NULL,
			revenue    bigint NOT NULL,
			created_at timestamptz NOT NULL DEFAULT now())`)
	return err
}
