package keeltest_test

// This file is the handlers guide's (docs/handlers.md) "Adding your own
// task" and "Testing your handlers": if it stops compiling or passing, the
// guide is wrong. Its examples need Redis and Postgres, so they show the
// test functions they would be in your package and are compiled, not run.

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/testenv"
	"github.com/keeljobs/keel/keeltest"
	"github.com/keeljobs/keel/retry"
	"github.com/keeljobs/keel/tasks"
)

type Welcome struct {
	UserID string `json:"user_id"`
}

var SendWelcome = tasks.Define[Welcome]("user:send_welcome",
	tasks.Queue("default"), tasks.MaxRetry(5),
	tasks.Key(func(w Welcome) string { return "user:" + w.UserID }))

func register(mux *tasks.Mux, pool *pgxpool.Pool) {
	tasks.Handle(mux, SendWelcome, func(ctx context.Context, w Welcome) error {
		// The local effect commits with the job's completion, or not at all.
		return idempotency.InTx(ctx, func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `INSERT INTO welcomes (user_id) VALUES ($1)`, w.UserID)
			return err
		})
	})
}

func TestAddingYourOwnTask(t *testing.T) {
	h := keeltest.New(t, keeltest.Options{RedisDB: testenv.DBKeeltest})
	ctx := context.Background()
	_, err := h.Pool.Exec(ctx, `CREATE TABLE welcomes (user_id text NOT NULL)`)
	require.NoError(t, err)

	// What a handler enqueues in its transaction is visible in it.
	tx, err := h.Pool.Begin(ctx)
	require.NoError(t, err)
	_, err = h.Client.EnqueueTx(ctx, tx, SendWelcome.New(Welcome{UserID: "7"}))
	require.NoError(t, err)
	keeltest.Enqueued(t, tx, "user:send_welcome", "user:7")
	require.NoError(t, tx.Rollback(ctx))
	keeltest.NotEnqueued(t, h.Pool, "user:send_welcome", "user:7")

	mux := tasks.NewMux()
	register(mux, h.Pool)
	job := h.Run(t, mux, SendWelcome.New(Welcome{UserID: "42"}))
	require.Equal(t, idempotency.StatusSucceeded, job.Status)
	h.Redeliver(t, job.ID) // a duplicate delivery changes nothing
	h.Drain(t, 10*time.Second)

	var n int
	require.NoError(t, h.Pool.QueryRow(ctx, `SELECT count(*) FROM welcomes WHERE user_id = '42'`).Scan(&n))
	require.Equal(t, 1, n)
}

// A handler's test: the job runs through keel's real middleware (the
// ledger's guard, the error classifier, the relay) against the test Redis
// and Postgres, and a second delivery of it changes nothing.
func Example() {
	testSendWelcome := func(t *testing.T) {
		// A Postgres schema of its own, migrated and dropped afterwards; a
		// Redis database number of this package's own.
		h := keeltest.New(t, keeltest.Options{RedisDB: 7})
		ctx := context.Background()
		if _, err := h.Pool.Exec(ctx, `CREATE TABLE welcomes (user_id text NOT NULL)`); err != nil {
			t.Fatal(err)
		}
		mux := tasks.NewMux()
		tasks.Handle(mux, SendWelcome, func(ctx context.Context, w Welcome) error {
			return idempotency.InTx(ctx, func(tx pgx.Tx) error {
				_, err := tx.Exec(ctx, `INSERT INTO welcomes (user_id) VALUES ($1)`, w.UserID)
				return err
			})
		})

		job := h.Run(t, mux, SendWelcome.New(Welcome{UserID: "42"})) // enqueue, start a worker, wait
		if job.Status != idempotency.StatusSucceeded {
			t.Fatalf("status %s: %s", job.Status, job.LastError)
		}
		h.Redeliver(t, job.ID)     // a duplicate delivery, as after a Redis failover…
		h.Drain(t, 10*time.Second) // …once processed…
		var n int
		if err := h.Pool.QueryRow(ctx, `SELECT count(*) FROM welcomes`).Scan(&n); err != nil || n != 1 {
			t.Fatalf("%d welcomes (%v), want 1", n, err) // …left one welcome
		}
	}
	_ = testSendWelcome
}

// What code enqueues in a transaction is in the ledger only if the
// transaction commits: Enqueued looks through the transaction before it
// does, NotEnqueued through the pool after a rollback.
func ExampleEnqueued() {
	testSignUpRollsBack := func(t *testing.T) {
		h := keeltest.New(t, keeltest.Options{RedisDB: 7})
		ctx := context.Background()
		tx, err := h.Pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		// What a sign-up handler would do in its transaction.
		if _, err := h.Client.EnqueueTx(ctx, tx, SendWelcome.New(Welcome{UserID: "7"})); err != nil {
			t.Fatal(err)
		}
		keeltest.Enqueued(t, tx, "user:send_welcome", "user:7")
		if err := tx.Rollback(ctx); err != nil {
			t.Fatal(err)
		}
		keeltest.NotEnqueued(t, h.Pool, "user:send_welcome", "user:7")
	}
	_ = testSignUpRollsBack
}

// A failure is classified as it would be in production: a permanent one
// is not retried, and Run returns the dead job with its class and error.
func ExampleHarness_Run() {
	testUnknownUserDies := func(t *testing.T) {
		h := keeltest.New(t, keeltest.Options{RedisDB: 7})
		mux := tasks.NewMux()
		tasks.Handle(mux, SendWelcome, func(ctx context.Context, w Welcome) error {
			return retry.Permanent(errors.New("no such user"))
		})
		job := h.Run(t, mux, SendWelcome.New(Welcome{UserID: "0"}))
		if job.Status != idempotency.StatusDead || job.Attempts != 1 || job.ErrorClass != "permanent" {
			t.Fatalf("%s after %d attempts, class %q: %s", job.Status, job.Attempts, job.ErrorClass, job.LastError)
		}
	}
	_ = testUnknownUserDies
}
