package chaos_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/retry"
	"github.com/keeljobs/keel/tasks"
)

// order is the payload of every soak kind: the business key, and the job's
// number, which picks its variations.
type order struct {
	Key string `json:"key"`
	N   int    `json:"n"`
}

func orderKey(o order) string { return o.Key }

var (
	okKind         = tasks.Define[order]("chaos:ok", tasks.Key(orderKey))
	transientKind  = tasks.Define[order]("chaos:transient", tasks.Key(orderKey))
	permanentKind  = tasks.Define[order]("chaos:permanent", tasks.Key(orderKey), tasks.Queue("low"))
	limitedKind    = tasks.Define[order]("chaos:limited", tasks.Key(orderKey), tasks.MaxRetry(2))
	slowKind       = tasks.Define[order]("chaos:slow", tasks.Key(orderKey), tasks.Queue("low"))
	externalKind   = tasks.Define[order]("chaos:external", tasks.Key(orderKey), tasks.Queue("critical"))
	unverifiedKind = tasks.Define[order]("chaos:external_unverified", tasks.Key(orderKey), tasks.Queue("critical"))
	// tickKind is the scheduler's; its business keys come from the scheduler.
	tickKind = tasks.Define[struct{}]("chaos:tick", tasks.Key(func(struct{}) string { return "" }), tasks.Queue("critical"))
)

const (
	// tickEntry is the scheduler entry's name, part of its tick keys.
	tickEntry = "chaos-tick"
	// limitedWaits is how many runs of a rate-limited job are postponed with
	// retry.Wait. Each run records the attempt it is: if waits counted, the
	// number would go up at every run (and with MaxRetry 2 the job could die).
	limitedWaits = 3
	// limitedRate is the flow rule's starts per second for limitedKind.
	limitedRate = 200
	// stepName is the external kinds' recorded step.
	stepName = "charge"
)

// class is one kind of job in the soak and the end it must come to.
type class struct {
	name string
	kind *tasks.Kind[order]
	// want is the terminal state the job must reach.
	want idempotency.Status
	// inDoubtOK allows the job to end dead "in doubt" instead: an external
	// call without Verify cut short by a kill.
	inDoubtOK bool
	// external jobs call the fake service once when they succeed.
	external bool
}

var classes = []*class{
	{name: "succeeding", kind: okKind, want: idempotency.StatusSucceeded},
	{name: "transient", kind: transientKind, want: idempotency.StatusSucceeded},
	{name: "permanent", kind: permanentKind, want: idempotency.StatusDead},
	{name: "rate-limited", kind: limitedKind, want: idempotency.StatusSucceeded},
	{name: "slow", kind: slowKind, want: idempotency.StatusSucceeded},
	{name: "external", kind: externalKind, want: idempotency.StatusSucceeded, external: true},
	{name: "external-unverified", kind: unverifiedKind, want: idempotency.StatusSucceeded, external: true, inDoubtOK: true},
}

// chaosSchema holds what the handlers write besides the ledger.
const chaosSchema = `
CREATE TABLE chaos_orders (
	business_key text PRIMARY KEY,
	created_at   timestamptz NOT NULL DEFAULT now());
-- One local effect per business key: a second one is a unique violation.
CREATE TABLE chaos_effects (
	business_key text PRIMARY KEY,
	kind         text NOT NULL,
	job_id       text NOT NULL,
	at           timestamptz NOT NULL DEFAULT now());
-- The fake external service's memory: every call it received.
CREATE TABLE chaos_external_calls (
	id           bigserial PRIMARY KEY,
	step_key     text NOT NULL,
	business_key text NOT NULL,
	at           timestamptz NOT NULL DEFAULT now());
CREATE INDEX chaos_external_calls_key ON chaos_external_calls (step_key);
-- The ledger attempt each run of a rate-limited job saw.
CREATE TABLE chaos_waits (
	business_key text PRIMARY KEY,
	attempts     integer[] NOT NULL);
-- Effects a handler tried to write twice (the unique index refused them).
CREATE TABLE chaos_violations (
	business_key text NOT NULL,
	kind         text NOT NULL,
	err          text NOT NULL,
	at           timestamptz NOT NULL DEFAULT now());
`

// chaosMux is the workers' handler set.
func chaosMux(pool *pgxpool.Pool) *tasks.Mux {
	mux := tasks.NewMux()
	tasks.Handle(mux, okKind, func(ctx context.Context, o order) error {
		return writeEffect(ctx, pool, okKind.Name(), o.Key)
	})
	tasks.Handle(mux, transientKind, func(ctx context.Context, o order) error {
		if a := idempotency.Attempt(ctx); a <= 1+o.N%2 {
			return retry.Transient(fmt.Errorf("chaos: %s: upstream timed out (attempt %d)", o.Key, a))
		}
		return writeEffect(ctx, pool, transientKind.Name(), o.Key)
	})
	tasks.Handle(mux, permanentKind, func(ctx context.Context, o order) error {
		return retry.Permanent(fmt.Errorf("chaos: %s: order rejected by a business rule", o.Key))
	})
	tasks.Handle(mux, limitedKind, func(ctx context.Context, o order) error {
		var n int
		err := pool.QueryRow(ctx, `INSERT INTO chaos_waits (business_key, attempts) VALUES ($1, ARRAY[$2::integer])
			ON CONFLICT (business_key) DO UPDATE SET attempts = array_append(chaos_waits.attempts, $2)
			RETURNING cardinality(attempts)`, o.Key, idempotency.Attempt(ctx)).Scan(&n)
		if err != nil {
			return err
		}
		if n <= limitedWaits {
			return retry.Wait(time.Second, fmt.Errorf("chaos: %s: partner quota not available yet (%d)", o.Key, n))
		}
		return writeEffect(ctx, pool, limitedKind.Name(), o.Key)
	})
	tasks.Handle(mux, slowKind, func(ctx context.Context, o order) error {
		if err := pause(ctx, 200*time.Millisecond+rand.N(300*time.Millisecond)); err != nil {
			return err
		}
		return writeEffect(ctx, pool, slowKind.Name(), o.Key)
	})
	tasks.Handle(mux, externalKind, func(ctx context.Context, o order) error {
		err := idempotency.Step(ctx, stepName, func(ctx context.Context, key string) error {
			return callExternal(ctx, pool, key, o.Key)
		}, idempotency.Verify(func(ctx context.Context, key string) (bool, error) {
			var n int
			err := pool.QueryRow(ctx, `SELECT count(*) FROM chaos_external_calls WHERE step_key = $1`, key).Scan(&n)
			return n > 0, err
		}))
		if err != nil {
			return err
		}
		return writeEffect(ctx, pool, externalKind.Name(), o.Key)
	})
	tasks.Handle(mux, unverifiedKind, func(ctx context.Context, o order) error {
		err := idempotency.Step(ctx, stepName, func(ctx context.Context, key string) error {
			return callExternal(ctx, pool, key, o.Key)
		})
		if err != nil {
			return err
		}
		return writeEffect(ctx, pool, unverifiedKind.Name(), o.Key)
	})
	mux.HandleTask(tickKind.Name(), asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
		key := t.Headers()[idempotency.HeaderBusinessKey]
		if key == "" {
			return retry.Permanent(errors.New("chaos: tick without a business key header"))
		}
		return writeEffect(ctx, pool, tickKind.Name(), key)
	}))
	return mux
}

// writeEffect is a handler's local effect, committed with the job's success.
// A unique violation means the effect was written before: it is recorded
// apart, so a double effect is counted even though the index refused it.
func writeEffect(ctx context.Context, pool *pgxpool.Pool, kind, key string) error {
	err := idempotency.InTx(ctx, func(tx pgx.Tx) error {
		id, _ := idempotency.JobID(ctx)
		_, err := tx.Exec(ctx, `INSERT INTO chaos_effects (business_key, kind, job_id) VALUES ($1, $2, $3)`, key, kind, id)
		return err
	})
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "23505" {
		_, _ = pool.Exec(context.WithoutCancel(ctx), `INSERT INTO chaos_violations (business_key, kind, err) VALUES ($1, $2, $3)`,
			key, kind, err.Error())
	}
	return err
}

// callExternal is the fake payment service: a network delay each way around
// recording the call under its idempotency key.
func callExternal(ctx context.Context, pool *pgxpool.Pool, stepKey, businessKey string) error {
	if err := pause(ctx, latency()); err != nil {
		return err // not sent
	}
	if _, err := pool.Exec(ctx, `INSERT INTO chaos_external_calls (step_key, business_key) VALUES ($1, $2)`,
		stepKey, businessKey); err != nil {
		// The insert may have committed before the error: the caller cannot
		// tell, so it must not call again blindly.
		return idempotency.InDoubt(err)
	}
	// The response leg ignores ctx: once the call happened, reporting an
	// error would tell Step it did not.
	time.Sleep(latency())
	return nil
}

func latency() time.Duration { return 20*time.Millisecond + rand.N(60*time.Millisecond) }

func pause(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}
