package chaos_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
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
	// Hang is how a hung job's handler behaves: hangAlways or hangFirst.
	Hang string `json:"hang,omitempty"`
	// Due is a deadline job's deadline, as the driver set it.
	Due time.Time `json:"due,omitzero"`
	// Gen is which job of a Unique kind's key this is: 1, whose handler
	// outlives its run, or 2, enqueued once the window has passed.
	Gen int `json:"gen,omitempty"`
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
	// rawKind calls fakeService with a client whose errors are raw.
	rawKind = tasks.Define[order]("chaos:external_raw", tasks.Key(orderKey), tasks.Queue("critical"))
	// poisonKind's handler kills the worker it runs in.
	poisonKind = tasks.Define[order]("chaos:poison", tasks.Key(orderKey), tasks.MaxRetry(poisonMaxRetry))
	// hungKind's handler ignores its context past its timeout.
	hungKind = tasks.Define[order]("chaos:hung", tasks.Key(orderKey), tasks.MaxRetry(2), tasks.Timeout(time.Second))
	// deployKind runs for longer than the workers' ShutdownTimeout and has no
	// retry at all: a deploy that cost an attempt would kill it.
	deployKind = tasks.Define[order]("chaos:deploy", tasks.Key(orderKey), tasks.MaxRetry(0))
	// deadlineKind's and expiringKind's jobs carry a deadline they cannot
	// meet: a run asks for a retry a minute later, past it. expiringKind
	// drops stale work instead of making a dead letter.
	deadlineKind = tasks.Define[order]("chaos:deadline", tasks.Key(orderKey), tasks.MaxRetry(3))
	expiringKind = tasks.Define[order]("chaos:expiring", tasks.Key(orderKey), tasks.MaxRetry(3), tasks.ExpireAtDeadline())
	// lateCallKind's step call ignores its context and, on the first
	// attempt, reaches fakeService long after the run was given up at its
	// timeout.
	lateCallKind = tasks.Define[order]("chaos:late_call", tasks.Key(orderKey), tasks.MaxRetry(3), tasks.Timeout(time.Second),
		tasks.Queue("critical"))
	// The Unique kinds' first job of a key outlives its run (cancelled, or
	// given up at its timeout); a second job of the key is enqueued once it
	// has ended, past the window.
	uniqueCancelKind = tasks.Define[order]("chaos:unique_cancelled", tasks.Key(orderKey), tasks.MaxRetry(0),
		tasks.Unique(time.Millisecond))
	uniqueTimeoutKind = tasks.Define[order]("chaos:unique_timed_out", tasks.Key(orderKey), tasks.MaxRetry(0),
		tasks.Unique(time.Millisecond), tasks.Timeout(time.Second))
	// committedKind commits its effect first and then runs on, past the
	// workers' ShutdownTimeout: a deploy cuts it short after its commit.
	committedKind = tasks.Define[order]("chaos:deploy_committed", tasks.Key(orderKey), tasks.MaxRetry(0))
	// longKind keeps the workers busy: a few seconds a job, arriving all
	// through the submissions, so no worker is ever idle.
	longKind = tasks.Define[order]("chaos:long", tasks.Key(orderKey), tasks.MaxRetry(3))
	// crashOnceKind's first attempt kills its worker; its last run must run
	// alone and succeeds. Its timeout bounds the wait to run alone (a fifth
	// of it) below longKind's run, so the run is handed back and its worker
	// drains for it.
	crashOnceKind = tasks.Define[order]("chaos:crash_once", tasks.Key(orderKey), tasks.MaxRetry(1), tasks.Timeout(10*time.Second))
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
	// poisonExit is the exit status of a worker a poison job killed: the
	// parent starts it again, as a supervisor would.
	poisonExit     = 75
	poisonMaxRetry = 1
	// How a hung job's handler behaves: it hangs on every attempt (and must
	// die with class timeout), or on its first only (and must succeed).
	hangAlways = "always"
	hangFirst  = "first"
	// deployRun is how long a deploy job runs: always longer than the
	// workers' ShutdownTimeout, so a SIGTERM cuts it short.
	deployRun = 4 * time.Second
	// lateCallCeiling is the longest a late call's client holds it back,
	// ignoring its context, waiting for a later run of its job to decide
	// about the step; the wait ends as soon as one has. It is a bound for a
	// soak gone wrong, not a delay the soak relies on.
	lateCallCeiling = 30 * time.Second
	// uniqueHang is how long a Unique kind's first handler acts after keel
	// let it go, renewing its interval's end as it goes.
	uniqueHang = 4 * time.Second
	// longRun is how long a long job runs (up to half as long again).
	longRun = 3 * time.Second
	// deadlineIn is a retried deadline job's deadline, from its submission;
	// a delayed one is due deadlineDelay after it (rounded up to a whole
	// second, as keel does), deadlineSlack before its deadline, so it
	// usually waits past it.
	deadlineIn    = 10 * time.Second
	deadlineDelay = time.Second
	deadlineSlack = 200 * time.Millisecond
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
	// external jobs call the fake service once when they succeed; service
	// ones call fakeService, the others the table chaos_external_calls.
	external, service bool
	// deadClass is the error class a job that must die dies with.
	deadClass string
	// crashOK allows the job to end dead with class crashed instead, when a
	// SIGKILL or a poison job may well cut its last run short: a MaxRetry(0)
	// job, or a hung one (its runs last seconds).
	crashOK bool
	// hang is a hung job's behaviour (order.Hang).
	hang string
	// deadline jobs are submitted with a deadline they cannot meet.
	deadline bool
	// scenario, when set, submits the class's jobs itself (uniqueScenario).
	scenario func(d *driver, ctx context.Context, s submission)
}

var classes = []*class{
	{name: "succeeding", kind: okKind, want: idempotency.StatusSucceeded},
	{name: "transient", kind: transientKind, want: idempotency.StatusSucceeded},
	{name: "permanent", kind: permanentKind, want: idempotency.StatusDead},
	{name: "rate-limited", kind: limitedKind, want: idempotency.StatusSucceeded},
	{name: "slow", kind: slowKind, want: idempotency.StatusSucceeded},
	{name: "external", kind: externalKind, want: idempotency.StatusSucceeded, external: true},
	{name: "external-unverified", kind: unverifiedKind, want: idempotency.StatusSucceeded, external: true, inDoubtOK: true},
	{name: "external-raw", kind: rawKind, want: idempotency.StatusSucceeded, external: true, service: true},
}

// Rare classes: a few jobs each (soakConfig says how many), spread over the
// run, because each costs a worker, a goroutine or seconds of a slot.
var (
	poisonClass   = &class{name: "poison", kind: poisonKind, want: idempotency.StatusDead, deadClass: string(retry.ClassCrashed)}
	hungClass     = &class{name: "hung", kind: hungKind, want: idempotency.StatusDead, deadClass: string(retry.ClassTimeout), hang: hangAlways, crashOK: true}
	hungOnceClass = &class{name: "hung-once", kind: hungKind, want: idempotency.StatusSucceeded, hang: hangFirst}
	deployClass   = &class{name: "deploy", kind: deployKind, want: idempotency.StatusSucceeded, crashOK: true}
	// Where keel's guarantees meet: a deadline and a backlog or a retry,
	// a timeout and a step's call, a dedupe window and a run keel let go,
	// a deploy and the completing InTx, running alone and a busy worker.
	deadlineClass  = &class{name: "deadline", kind: deadlineKind, want: idempotency.StatusDead, deadClass: string(retry.ClassDeadline), deadline: true}
	expiringClass  = &class{name: "expiring", kind: expiringKind, want: idempotency.StatusDiscarded, deadClass: string(retry.ClassExpired), deadline: true}
	lateCallClass  = &class{name: "late-call", kind: lateCallKind, want: idempotency.StatusSucceeded, external: true, service: true}
	uniqueCancel   = &class{name: "unique-cancelled", kind: uniqueCancelKind, want: idempotency.StatusSucceeded, crashOK: true}
	uniqueTimeout  = &class{name: "unique-timed-out", kind: uniqueTimeoutKind, want: idempotency.StatusSucceeded, crashOK: true}
	committedClass = &class{name: "deploy-committed", kind: committedKind, want: idempotency.StatusSucceeded, crashOK: true}
	longClass      = &class{name: "long", kind: longKind, want: idempotency.StatusSucceeded, crashOK: true}
	crashOnceClass = &class{name: "crash-once", kind: crashOnceKind, want: idempotency.StatusSucceeded}
)

func init() {
	// Set here: the scenarios refer to the classes.
	uniqueCancel.scenario = (*driver).uniqueScenario
	uniqueTimeout.scenario = (*driver).uniqueScenario
}

// allClasses lists every class, in the report's order.
var allClasses = append(append([]*class{}, classes...), poisonClass, hungClass, hungOnceClass, deployClass,
	deadlineClass, expiringClass, lateCallClass, uniqueCancel, uniqueTimeout, committedClass, longClass, crashOnceClass)

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
-- Every run of the rare kinds' handlers, committed when it starts.
CREATE TABLE chaos_runs (
	business_key text NOT NULL,
	attempt      integer NOT NULL,
	at           timestamptz NOT NULL DEFAULT clock_timestamp());
-- What a hung run's late Step and InTx returned, after keel gave it up.
CREATE TABLE chaos_late (
	business_key text NOT NULL,
	attempt      integer NOT NULL,
	given_up     boolean NOT NULL,
	step_err     text NOT NULL,
	tx_err       text NOT NULL);
-- Effects a handler tried to write twice (the unique index refused them).
-- Workflows variant: a run that started before a parent of its job had
-- succeeded, and every committed effect of a workflow job.
CREATE TABLE chaos_flow_early (job_id text NOT NULL, parent text NOT NULL);
CREATE TABLE chaos_flow_effects (job_id text NOT NULL);
-- Every committed run of a batch callback (batches variant).
CREATE TABLE chaos_batch_callbacks (
	batch_id     text NOT NULL,
	event        text NOT NULL,
	generation   integer NOT NULL,
	counts       jsonb NOT NULL,
	job_id       text NOT NULL);
-- Every run of a deadline job, with its deadline; started is the
-- handler's clock when it began.
CREATE TABLE chaos_deadline_runs (
	business_key text NOT NULL,
	due          timestamptz NOT NULL,
	started      timestamptz NOT NULL);
-- Later runs of late-call jobs and what their step did: waited for an
-- earlier run's call in flight, or went past it.
CREATE TABLE chaos_call_waits (
	business_key text NOT NULL,
	waited       boolean NOT NULL,
	at           timestamptz NOT NULL DEFAULT clock_timestamp());
-- Every run of a Unique kind's handler: when it started and the last time
-- it was seen acting (renewed as it goes, so a killed run's end is known
-- to within a moment).
CREATE TABLE chaos_key_runs (
	id           bigserial PRIMARY KEY,
	business_key text NOT NULL,
	job_id       text NOT NULL,
	gen          integer NOT NULL,
	started_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
	ended_at     timestamptz NOT NULL DEFAULT clock_timestamp());
-- Runs of deploy-committed jobs past their completing InTx (holder: the
-- worker's name, so a deploy can aim at them; done once the run returns),
-- and those a deploy cut short.
CREATE TABLE chaos_after_commit (
	business_key text NOT NULL,
	holder       text NOT NULL,
	done         boolean NOT NULL DEFAULT false);
CREATE TABLE chaos_cut (
	business_key text NOT NULL,
	err          text NOT NULL);
-- Every death the workers alerted (GuardConfig.OnDead).
CREATE TABLE chaos_alerts (
	job_id       text NOT NULL,
	kind         text NOT NULL,
	class        text NOT NULL);
CREATE TABLE chaos_violations (
	business_key text NOT NULL,
	kind         text NOT NULL,
	err          text NOT NULL,
	at           timestamptz NOT NULL DEFAULT now());
`

// chaosMux is the workers' handler set.
func chaosMux(pool *pgxpool.Pool, svc *serviceClient, log *slog.Logger) *tasks.Mux {
	mux := tasks.NewMux()
	tasks.Handle(mux, flowKind, runFlowStep(pool))
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
	tasks.Handle(mux, rawKind, func(ctx context.Context, o order) error {
		// Errors reach Step unmarked: keel must hold them in doubt.
		err := idempotency.Step(ctx, stepName, func(ctx context.Context, key string) error {
			return svc.charge(ctx, key, o.Key)
		}, idempotency.Verify(svc.charged))
		if err != nil {
			return err
		}
		return writeEffect(ctx, pool, rawKind.Name(), o.Key)
	})
	tasks.Handle(mux, poisonKind, func(ctx context.Context, o order) error {
		if err := recordRun(ctx, pool, o.Key); err != nil {
			return err
		}
		log.Warn("chaos worker: poison job, exiting", "key", o.Key, "attempt", idempotency.Attempt(ctx))
		os.Exit(poisonExit) // what an OOM kill or a segfault does
		return nil
	})
	tasks.Handle(mux, hungKind, func(ctx context.Context, o order) error {
		if err := recordRun(ctx, pool, o.Key); err != nil {
			return err
		}
		if o.Hang == hangAlways || idempotency.Attempt(ctx) == 1 {
			return hang(ctx, pool, o.Key)
		}
		return writeEffect(ctx, pool, hungKind.Name(), o.Key)
	})
	tasks.Handle(mux, deployKind, func(ctx context.Context, o order) error {
		if err := recordRun(ctx, pool, o.Key); err != nil {
			return err
		}
		// Twice deployRun: a SIGTERM cuts short a deploy job that has run
		// less than 5 s of its 8–10 s, so the worker running the most of
		// them is cut mid-run, not let finish within its ShutdownTimeout.
		if err := pause(ctx, 2*deployRun+rand.N(deployRun/2)); err != nil {
			return fmt.Errorf("chaos: %s: cut short: %w", o.Key, err)
		}
		return writeEffect(ctx, pool, deployKind.Name(), o.Key)
	})
	for _, k := range []*tasks.Kind[order]{deadlineKind, expiringKind} {
		tasks.Handle(mux, k, func(ctx context.Context, o order) error {
			// Recorded whatever ctx says: a run that starts past its
			// deadline is what the check looks for.
			if _, err := pool.Exec(context.WithoutCancel(ctx), `INSERT INTO chaos_deadline_runs (business_key, due, started)
				VALUES ($1, $2, $3)`, o.Key, o.Due, time.Now()); err != nil {
				return err
			}
			return retry.After(time.Minute, fmt.Errorf("chaos: %s: the partner is down for a minute", o.Key))
		})
	}
	tasks.Handle(mux, lateCallKind, func(ctx context.Context, o order) error {
		// The first attempt's call outlives its run; a later one, made
		// when a kill or a deploy cut that call off before it was sent
		// (Verify finds nothing), is prompt, so the job keeps its budget.
		// The first attempt's call is held until a later run has decided
		// about the step, rather than for a time that a busy host's retry
		// delays could outlast (the check that this joint was exercised
		// would then fail by chance). That run either found the call in
		// flight, or went past the step: then the late call lands right
		// after it, and a step called twice shows in the service's count.
		attempt := idempotency.Attempt(ctx)
		hold := func() {}
		if attempt == 1 {
			hold = func() { awaitStepDecided(pool, o.Key) }
		}
		err := idempotency.Step(ctx, stepName, func(ctx context.Context, key string) error {
			return svc.chargeLate(key, o.Key, hold)
		}, idempotency.Verify(svc.charged))
		if attempt > 1 {
			_, _ = pool.Exec(context.WithoutCancel(ctx), `INSERT INTO chaos_call_waits (business_key, waited) VALUES ($1, $2)`,
				o.Key, errors.Is(err, idempotency.ErrCallInFlight))
		}
		if err != nil {
			return err
		}
		return writeEffect(ctx, pool, lateCallKind.Name(), o.Key)
	})
	for _, k := range []*tasks.Kind[order]{uniqueCancelKind, uniqueTimeoutKind} {
		tasks.Handle(mux, k, func(ctx context.Context, o order) error {
			return uniqueRun(ctx, pool, k, o)
		})
	}
	tasks.Handle(mux, committedKind, func(ctx context.Context, o order) error {
		if err := recordRun(ctx, pool, o.Key); err != nil {
			return err
		}
		if err := writeEffect(ctx, pool, committedKind.Name(), o.Key); err != nil {
			return err
		}
		// After the completing InTx: a cache refresh, a log flush.
		late := context.WithoutCancel(ctx)
		_, _ = pool.Exec(late, `INSERT INTO chaos_after_commit (business_key, holder) VALUES ($1, $2)`, o.Key, os.Getenv(envWorker))
		defer func() {
			_, _ = pool.Exec(late, `UPDATE chaos_after_commit SET done = true WHERE business_key = $1`, o.Key)
		}()
		// Twice a deploy job's run: a deploy that finds it past its commit
		// cuts it short (ShutdownTimeout is 3 s).
		if err := pause(ctx, 2*deployRun+rand.N(deployRun)); err != nil {
			_, _ = pool.Exec(context.WithoutCancel(ctx), `INSERT INTO chaos_cut (business_key, err) VALUES ($1, $2)`, o.Key, err.Error())
			return fmt.Errorf("chaos: %s: cut short after its commit: %w", o.Key, err)
		}
		return nil
	})
	tasks.Handle(mux, longKind, func(ctx context.Context, o order) error {
		if err := pause(ctx, longRun+rand.N(longRun/2)); err != nil {
			return err
		}
		return writeEffect(ctx, pool, longKind.Name(), o.Key)
	})
	tasks.Handle(mux, crashOnceKind, func(ctx context.Context, o order) error {
		if err := recordRun(ctx, pool, o.Key); err != nil {
			return err
		}
		if idempotency.Attempt(ctx) == 1 {
			log.Warn("chaos worker: crash-once job, exiting", "key", o.Key)
			os.Exit(poisonExit)
		}
		return writeEffect(ctx, pool, crashOnceKind.Name(), o.Key)
	})
	mux.HandleTask(tickKind.Name(), asynq.HandlerFunc(func(ctx context.Context, t *asynq.Task) error {
		key := t.Headers()[tasks.HeaderBusinessKey]
		if key == "" {
			return retry.Permanent(errors.New("chaos: tick without a business key header"))
		}
		return writeEffect(ctx, pool, tickKind.Name(), key)
	}))
	tasks.Handle(mux, batchDoneKind, func(ctx context.Context, d tasks.BatchDone) error {
		return recordBatchCallback(ctx, d)
	})
	return mux
}

// recordRun notes that a run started, before it does anything else.
func recordRun(ctx context.Context, pool *pgxpool.Pool, key string) error {
	_, err := pool.Exec(ctx, `INSERT INTO chaos_runs (business_key, attempt) VALUES ($1, $2)`, key, idempotency.Attempt(ctx))
	return err
}

// uniqueRun is a Unique kind's handler. It records its interval in
// chaos_key_runs: its start, and its end renewed while it acts. The first
// job of a key acts for uniqueHang whatever its context says (keel cancels
// it, or gives it up at its timeout); the second writes its effect.
func uniqueRun(ctx context.Context, pool *pgxpool.Pool, kind *tasks.Kind[order], o order) error {
	late := context.WithoutCancel(ctx)
	id, _ := idempotency.JobID(ctx)
	var run int64
	if err := pool.QueryRow(ctx, `INSERT INTO chaos_key_runs (business_key, job_id, gen) VALUES ($1, $2, $3) RETURNING id`,
		o.Key, id, o.Gen).Scan(&run); err != nil {
		return err
	}
	seen := func() {
		_, _ = pool.Exec(late, `UPDATE chaos_key_runs SET ended_at = clock_timestamp() WHERE id = $1`, run)
	}
	defer seen()
	if o.Gen == 1 {
		for end := time.Now().Add(uniqueHang); time.Now().Before(end); {
			time.Sleep(200 * time.Millisecond)
			seen()
		}
		return nil
	}
	if err := pause(ctx, 100*time.Millisecond); err != nil {
		return err
	}
	return writeEffect(ctx, pool, kind.Name(), o.Key)
}

// hang is a handler that ignores its context: it carries on until the
// ledger shows keel has given its run up (or anyone else has the job), then
// tries to finish as if nothing had happened — a recorded external call and
// the completing InTx — and records what keel answered. Both must be
// refused: a given-up run must not commit anything.
func hang(ctx context.Context, pool *pgxpool.Pool, key string) error {
	late := context.WithoutCancel(ctx) // the late finish does not look at ctx either
	id, _ := idempotency.JobID(ctx)
	attempt := idempotency.Attempt(ctx)
	givenUp := false
	for deadline := time.Now().Add(time.Minute); time.Now().Before(deadline); {
		var held bool
		err := pool.QueryRow(late, `SELECT status = 'running' AND attempts = $2 FROM keel_jobs WHERE id = $1`, id, attempt).Scan(&held)
		if err == nil && !held {
			givenUp = true
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	stepErr := idempotency.Step(late, "late-call", func(ctx context.Context, stepKey string) error {
		return callExternal(ctx, pool, stepKey, key)
	})
	txErr := writeEffect(late, pool, hungKind.Name(), key)
	_, err := pool.Exec(late, `INSERT INTO chaos_late (business_key, attempt, given_up, step_err, tx_err) VALUES ($1, $2, $3, $4, $5)`,
		key, attempt, givenUp, errText(stepErr), errText(txErr))
	return errors.Join(txErr, err)
}

func errText(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
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

// awaitStepDecided returns once a later run of the late-call job key has
// decided about its step (a chaos_call_waits row: it found the first run's
// call in flight, or went past the step), or at lateCallCeiling. Errors (a
// restarting Postgres) only mean it looks again.
func awaitStepDecided(pool *pgxpool.Pool, key string) {
	end := time.Now().Add(lateCallCeiling)
	for time.Now().Before(end) {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		var found bool
		err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM chaos_call_waits WHERE business_key = $1)`, key).Scan(&found)
		cancel()
		if err == nil && found {
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
}
