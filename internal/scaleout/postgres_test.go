package scaleout_test

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/executor"
	"github.com/keeljobs/keel/internal/jobstore"
	"github.com/keeljobs/keel/internal/testenv"
	"github.com/keeljobs/keel/internal/testworker"
	"github.com/keeljobs/keel/migrate"
	"github.com/keeljobs/keel/outbox"
	"github.com/keeljobs/keel/scheduler"
	"github.com/keeljobs/keel/server"
	"github.com/keeljobs/keel/tasks"
	"github.com/keeljobs/keel/web"
)

var (
	// No retries: an attempt or a crash the outage charged would kill a job.
	pgWork = tasks.Define[job]("pgaway:work", tasks.Queue("default"), tasks.MaxRetry(0),
		tasks.Key(func(j job) string { return fmt.Sprint(j.N) }))
	pgTick = tasks.Define[struct{}]("pgaway:tick", tasks.Queue("default"), tasks.Key(func(struct{}) string { return "" }))
)

// calls counts an external side effect per business key, on the far side
// of the ledger: it dedupes nothing, so a repeated call shows.
type calls struct {
	mu sync.Mutex
	n  map[string]int
}

func (c *calls) add(key string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.n[key]++
}

func (c *calls) get(key string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n[key]
}

// pgLease is shorter than the default so that the long outage outlasts a
// lease many times over without making the test slow.
const pgLease = 3 * time.Second

// TestPostgresGoesAway runs a worker (guard, relay, reconciler and rescuer),
// a scheduler firing every second and the dashboard against a private
// Postgres, cuts every keel connection and then stops Postgres mid-run, and
// checks that nothing was lost, repeated or charged to the jobs, and that
// everything works again without a restart.
func TestPostgresGoesAway(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name string
		down time.Duration
	}{
		{"short outage", time.Second},
		{"outage longer than a lease", 2*pgLease + time.Second},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			postgresGoesAway(t, c.down)
		})
	}
}

func postgresGoesAway(t *testing.T, down time.Duration) {
	const before, after = 240, 60
	pg := testenv.StartPostgres(t)
	rs := testenv.StartRedis(t)
	opt := asynq.RedisClientOpt{Addr: rs.Addr()}
	ctx := context.Background()
	cfg, err := pgxpool.ParseConfig(pg.URL(""))
	require.NoError(t, err)
	cfg.MaxConns = 20
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	_, err = migrate.Up(ctx, pool)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `CREATE TABLE effects (key text PRIMARY KEY, done_at timestamptz NOT NULL DEFAULT clock_timestamp())`)
	require.NoError(t, err)

	external := &calls{n: map[string]int{}}
	// A run starts its work only with a token the test hands out, so that
	// work is left for each stage however fast the host runs the jobs
	// (unbounded, the worker once finished 235 of 240 before the cut).
	tokens := make(chan struct{}, before+after)
	let := func(n int) {
		for range n {
			tokens <- struct{}{}
		}
	}
	mux := tasks.NewMux()
	tasks.Handle(mux, pgWork, func(ctx context.Context, j job) error {
		select {
		case <-tokens:
		case <-ctx.Done():
			return ctx.Err()
		}
		key := fmt.Sprint(j.N)
		err := idempotency.Step(ctx, "notify", func(context.Context, string) error {
			external.add(key)
			return nil
		}, idempotency.Verify(func(context.Context, string) (bool, error) { return external.get(key) > 0, nil }))
		if err != nil {
			return err
		}
		time.Sleep(20 * time.Millisecond) // work, so that runs are in flight when Postgres goes
		return idempotency.InTx(ctx, func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `INSERT INTO effects (key) VALUES ($1)`, key)
			return err
		})
	})
	tasks.Handle(mux, pgTick, func(context.Context, struct{}) error { return nil })
	srv, client := outageWorker(t, opt, pool, mux, 8, executor.GuardConfig{Lease: pgLease})
	sched, err := scheduler.New(scheduler.Config{Client: client, Kinds: tasks.NewKinds(pgTick), Logger: slog.New(slog.DiscardHandler),
		Entries: []scheduler.Entry{{Name: "pgaway", Spec: "@every 1s", Kind: pgTick.Name()}}})
	require.NoError(t, err)
	runInBackground(t, sched.Run)

	dash, err := web.New(web.Config{Addr: "127.0.0.1:0", Redis: opt, Pool: pool, ProxyUserHeader: "X-Forwarded-User",
		Secret: []byte(strings.Repeat("s", web.MinSecretBytes)), Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	t.Cleanup(dash.Close)
	ts := httptest.NewServer(dash.Handler())
	t.Cleanup(ts.Close)
	deadLetters := func() int {
		req, _ := http.NewRequest(http.MethodGet, ts.URL+"/dead", nil)
		req.Header.Set("X-Forwarded-User", "ops")
		resp, err := ts.Client().Do(req)
		if err != nil {
			return 0
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	require.Equal(t, http.StatusOK, deadLetters())

	// Half the jobs through EnqueueTx: the relay publishes those. A
	// producer tries again when the ledger refused (a pooled connection
	// the restart cut, say): the same key is the same job.
	enqueue := func(from, to int) {
		for i := from; i < to; i++ {
			var err error
			for try := 0; try < 3; try++ {
				if i%2 == 0 {
					_, err = client.Enqueue(ctx, pgWork.New(job{N: i}))
				} else {
					err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
						_, err := client.EnqueueTx(ctx, tx, pgWork.New(job{N: i}))
						return err
					})
				}
				if err == nil {
					break
				}
			}
			require.NoError(t, err)
		}
	}
	effects := func() int {
		var n int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM effects`).Scan(&n); err != nil {
			return -1
		}
		return n
	}
	enqueue(0, before)
	let(20)
	testenv.Eventually(t, 30*time.Second, func() bool { return effects() >= 20 }, "jobs never started")

	// Every keel connection cut at once, Postgres itself still up.
	admin, err := pgx.Connect(ctx, pg.URL(""))
	require.NoError(t, err)
	var cut int
	require.NoError(t, admin.QueryRow(ctx, `SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity
		WHERE pid <> pg_backend_pid() AND backend_type = 'client backend') s`).Scan(&cut))
	admin.Close(ctx)
	require.Positive(t, cut)
	atCut := effects()
	let(20)
	testenv.Eventually(t, 30*time.Second, func() bool { return effects() >= atCut+20 }, "jobs stopped after the connections were cut")
	let(8) // one a worker slot: runs in flight when Postgres goes

	// Postgres stopped (fast shutdown) with jobs in flight, down for a
	// while, then back on the same port.
	inFlight := effects()
	require.Less(t, inFlight, before, "every job finished before Postgres went: nothing was in flight")
	pg.Stop()
	require.Equal(t, http.StatusServiceUnavailable, deadLetters(), "the dashboard without its ledger")
	time.Sleep(down)
	pg.Start()
	up := time.Now()
	close(tokens)

	// Jobs enqueued after the restart run too: the first to finish marks
	// how long recovery took.
	enqueue(before, before+after)
	var firstDone time.Time
	testenv.Eventually(t, 60*time.Second, func() bool {
		return pool.QueryRow(ctx, `SELECT min(done_at) FROM effects WHERE done_at > $1`, up).Scan(&firstDone) == nil && !firstDone.IsZero()
	}, "no job finished after Postgres came back")
	t.Logf("Postgres down %s; first job finished %s after it was back", down, firstDone.Sub(up).Round(time.Millisecond))

	testenv.Eventually(t, 90*time.Second, func() bool {
		var done int
		return pool.QueryRow(ctx, `SELECT count(*) FROM keel_jobs WHERE kind = $1 AND status = 'succeeded'`, pgWork.Name()).Scan(&done) == nil &&
			done == before+after
	}, "not every job succeeded after Postgres came back")
	t.Logf("every job succeeded %s after Postgres was back", time.Since(up).Round(100*time.Millisecond))

	require.Equal(t, before+after, effects(), "local effects")
	for i := range before + after {
		require.Equal(t, 1, external.get(fmt.Sprint(i)), "external calls of job %d", i)
	}
	rows, err := pool.Query(ctx, `SELECT business_key, attempts, crashes FROM keel_jobs
		WHERE kind = $1 AND (attempts <> 1 OR crashes <> 0) ORDER BY business_key`, pgWork.Name())
	require.NoError(t, err)
	charged, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (string, error) {
		var key string
		var attempts, crashes int
		err := r.Scan(&key, &attempts, &crashes)
		return fmt.Sprintf("%s: %d attempts, %d crashes", key, attempts, crashes), err
	})
	require.NoError(t, err)
	require.Empty(t, charged, "the outage was charged to jobs")
	st := srv.GuardStats()
	require.Zero(t, st.Crashed, "jobs retired as crashed")
	require.Zero(t, st.Dead, "jobs died")

	// The scheduler fires again, the dashboard answers again, the relay
	// listens again.
	testenv.Eventually(t, 30*time.Second, func() bool {
		var n int
		return pool.QueryRow(ctx, `SELECT count(*) FROM keel_jobs WHERE kind = $1 AND status = 'succeeded' AND created_at > $2`,
			pgTick.Name(), up).Scan(&n) == nil && n > 0
	}, "the scheduler never fired after Postgres came back")
	testenv.Eventually(t, 30*time.Second, func() bool { return deadLetters() == http.StatusOK }, "the dashboard never answered again")
	testenv.Eventually(t, 30*time.Second, srv.Relay().Listening, "the relay never listened again")

	// The reconciler works again: lose a job from Redis and get it back.
	lost, err := client.Enqueue(ctx, pgWork.New(job{N: 10_000}, tasks.Delay(time.Hour)))
	require.NoError(t, err)
	insp := asynq.NewInspector(opt)
	defer insp.Close()
	require.NoError(t, insp.DeleteTask(pgWork.Queue(), lost.Job.ID))
	_, err = pool.Exec(ctx, `UPDATE keel_jobs SET updated_at = now() - interval '1 hour' WHERE id = $1`, lost.Job.ID)
	require.NoError(t, err)
	testenv.Eventually(t, 30*time.Second, func() bool {
		info, err := insp.GetTaskInfo(pgWork.Queue(), lost.Job.ID)
		return err == nil && info.State == asynq.TaskStateScheduled
	}, "the reconciler never published a lost job again")
}

// runInBackground runs fn until the test ends.
func runInBackground(t *testing.T, fn func(context.Context) error) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- fn(ctx) }()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-done)
	})
}

// privateLedger starts a private Postgres, migrated, with an effects table
// keyed by text, and a private Redis.
func privateLedger(t *testing.T) (*testenv.PostgresServer, asynq.RedisClientOpt, *pgxpool.Pool) {
	t.Helper()
	pg := testenv.StartPostgres(t)
	rs := testenv.StartRedis(t)
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, pg.URL(""))
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	_, err = migrate.Up(ctx, pool)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `CREATE TABLE effects (key text PRIMARY KEY)`)
	require.NoError(t, err)
	return pg, asynq.RedisClientOpt{Addr: rs.Addr()}, pool
}

// outageWorker runs a keel worker on the private ledger, its relay and
// reconciler polling fast, until the test ends, and a client for it.
func outageWorker(t *testing.T, opt asynq.RedisClientOpt, pool *pgxpool.Pool, mux *tasks.Mux, concurrency int,
	guard executor.GuardConfig) (*server.Server, *tasks.Client) {
	t.Helper()
	srv := testworker.RunServer(t, server.Config{Redis: opt, Pool: pool, Concurrency: concurrency, ShutdownTimeout: 2 * time.Second,
		Guard:      guard,
		Relay:      outbox.RelayConfig{PollInterval: 100 * time.Millisecond},
		Reconciler: outbox.ReconcilerConfig{Interval: time.Second},
		Logger:     testenv.LogOnFailure(t)}, mux)
	client, err := tasks.NewClient(tasks.ClientConfig{Redis: opt, Pool: pool})
	require.NoError(t, err)
	t.Cleanup(func() { client.Close() })
	return srv, client
}

var (
	pgPlain = tasks.Define[job]("pgaway:plain", tasks.Queue("default"), tasks.MaxRetry(0),
		tasks.Key(func(j job) string { return fmt.Sprint(j.N) }))
	pgLocal = tasks.Define[job]("pgaway:local", tasks.Queue("default"), tasks.MaxRetry(0),
		tasks.Key(func(j job) string { return fmt.Sprint(j.N) }))
)

// TestPostgresOutageNeverRetiresAJob: runs that end while Postgres is down,
// for longer than their lease, cannot write their outcome. Had the worker
// let go of them, their leases would run out and the next claims count
// crashes, retiring jobs without retries as crashed poison jobs. One
// handler succeeds without InTx (its completion mark waits for the
// ledger), one meets the outage in its InTx (its wait is written when the
// ledger is back).
func TestPostgresOutageNeverRetiresAJob(t *testing.T) {
	t.Parallel()
	pg, opt, pool := privateLedger(t)
	ctx := context.Background()

	started := make(chan string, 2)
	release := make(chan struct{})
	var plainRuns, localRuns atomic.Int32
	mux := tasks.NewMux()
	tasks.Handle(mux, pgPlain, func(ctx context.Context, j job) error {
		if plainRuns.Add(1) == 1 {
			started <- "plain"
			<-release
		}
		return nil
	})
	tasks.Handle(mux, pgLocal, func(ctx context.Context, j job) error {
		if localRuns.Add(1) == 1 {
			started <- "local"
			<-release
		}
		return idempotency.InTx(ctx, func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `INSERT INTO effects (key) VALUES ('local')`)
			return err
		})
	})
	const lease = time.Second
	srv, client := outageWorker(t, opt, pool, mux, 4, executor.GuardConfig{Lease: lease, LedgerRetry: time.Second})
	plain, err := client.Enqueue(ctx, pgPlain.New(job{N: 1}))
	require.NoError(t, err)
	local, err := client.Enqueue(ctx, pgLocal.New(job{N: 1}))
	require.NoError(t, err)
	<-started
	<-started

	pg.Stop()
	close(release)
	// The outage outlasts the runs' leases several times over.
	testenv.Eventually(t, 30*time.Second, func() bool { return srv.GuardStats().LedgerErrors >= 2 }, "the runs never met the outage")
	time.Sleep(3 * lease)
	pg.Start()

	for _, id := range []string{plain.Job.ID, local.Job.ID} {
		var status, lastError string
		testenv.Eventually(t, 30*time.Second, func() bool {
			return pool.QueryRow(ctx, `SELECT status, coalesce(last_error, '') FROM keel_jobs WHERE id = $1`, id).Scan(&status, &lastError) == nil &&
				status == "succeeded"
		}, "job %s did not succeed after the outage: %s %s", id, &status, &lastError)
		var attempts, crashes int
		require.NoError(t, pool.QueryRow(ctx, `SELECT attempts, crashes FROM keel_jobs WHERE id = $1`, id).Scan(&attempts, &crashes))
		require.Equal(t, 1, attempts, "job %s: attempts", id)
		require.Zero(t, crashes, "job %s: crashes", id)
	}
	require.Zero(t, srv.GuardStats().Crashed)
	require.EqualValues(t, 1, plainRuns.Load(), "the plain handler ran again")
	var effects int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM effects`).Scan(&effects))
	require.Equal(t, 1, effects)
}

var pgAfter = tasks.Define[job]("pgaway:after", tasks.Queue("default"), tasks.MaxRetry(3),
	tasks.Key(func(j job) string { return fmt.Sprint(j.N) }))

// TestFailureAfterCompletingInTxDuringOutageIsRecorded: a handler fails
// after its completing InTx committed, and Postgres is down when the guard
// records that. The record waits for Postgres: the job ends dead with its
// effects committed (not replayable), with one death alert, instead of
// staying "succeeded" with the failure lost.
func TestFailureAfterCompletingInTxDuringOutageIsRecorded(t *testing.T) {
	t.Parallel()
	pg, opt, pool := privateLedger(t)
	ctx := context.Background()

	committed := make(chan struct{}, 1)
	release := make(chan struct{})
	var runs atomic.Int32
	mux := tasks.NewMux()
	tasks.Handle(mux, pgAfter, func(ctx context.Context, j job) error {
		runs.Add(1)
		if err := idempotency.InTx(ctx, func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `INSERT INTO effects (key) VALUES ('after')`)
			return err
		}); err != nil {
			return err
		}
		committed <- struct{}{}
		<-release
		return fmt.Errorf("the mail after the commit failed")
	})
	var deaths atomic.Int32
	srv, client := outageWorker(t, opt, pool, mux, 2, executor.GuardConfig{Lease: time.Second, LedgerRetry: time.Second,
		OnDead: func(context.Context, jobstore.DeadEvent) { deaths.Add(1) }})
	res, err := client.Enqueue(ctx, pgAfter.New(job{N: 1}))
	require.NoError(t, err)
	<-committed

	pg.Stop()
	errsBefore := srv.GuardStats().LedgerErrors
	close(release)
	testenv.Eventually(t, 30*time.Second, func() bool { return srv.GuardStats().LedgerErrors > errsBefore },
		"the failure never met the outage")
	pg.Start()

	var status string
	var effectsAt *time.Time
	testenv.Eventually(t, 30*time.Second, func() bool {
		return pool.QueryRow(ctx, `SELECT status, effects_committed_at FROM keel_jobs WHERE id = $1`, res.Job.ID).
			Scan(&status, &effectsAt) == nil && status == "dead"
	}, "the failure after the completing InTx was not recorded")
	require.NotNil(t, effectsAt)
	testenv.Eventually(t, 10*time.Second, func() bool { return deaths.Load() == 1 }, "no death alert")
	require.EqualValues(t, 1, runs.Load())
	var effects int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM effects`).Scan(&effects))
	require.Equal(t, 1, effects)
}
