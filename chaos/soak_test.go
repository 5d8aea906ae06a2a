package chaos_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/testenv"
	"github.com/keeljobs/keel/outbox"
	"github.com/keeljobs/keel/scheduler"
	"github.com/keeljobs/keel/tasks"
)

const schema = "keel_test_chaos"

// Environment the soak reads (see the package doc).
const (
	envDatabaseURL = "KEEL_CHAOS_DATABASE_URL"
	envPGRestart   = "KEEL_CHAOS_PG_RESTART_CMD"
	envLogDir      = "KEEL_CHAOS_LOG_DIR"
)

// soakConfig sizes one soak. Times are offsets from the start of the run.
type soakConfig struct {
	Jobs       int
	Workers    int
	Submitters int
	// SubmitOver spreads the submissions evenly over this long.
	SubmitOver time.Duration
	// Kills are when a worker is killed with SIGKILL (and restarted).
	Kills []time.Duration
	// RedisRestarts are when Redis is stopped, for RedisDown, and started
	// again empty.
	RedisRestarts []time.Duration
	RedisDown     time.Duration
	// Deploys are when a worker is sent SIGTERM, in the middle of deploy
	// jobs if it can be, and started again once it has stopped.
	Deploys []time.Duration
	// How many jobs of the rare classes to submit, spread over the run:
	// poison (each kills two workers), hung (half always hang, half on
	// their first attempt) and deploy (long MaxRetry(0) jobs).
	Poison, Hung, DeployJobs int
	// Where keel's guarantees meet, also spread over the run: deadline jobs
	// (half dead at their deadline, half of an expiring kind; some in a
	// batch of their own), late step calls, Unique keys whose first job
	// outlives its run (half cancelled, half timed out), deploy jobs cut
	// short after their commit, long jobs keeping every worker busy, and
	// jobs that crash their worker once and then must run alone.
	Deadlines, LateCalls, Uniques, CommittedCuts, LongJobs, CrashOnce int
	// PGRestartAt is when KEEL_CHAOS_PG_RESTART_CMD runs, if it is set.
	PGRestartAt time.Duration
	// Deadline bounds the whole run, until every job is terminal.
	Deadline time.Duration
	// Batches, when positive, puts every job into one of this many batches
	// (job n into batch n%Batches), sealed once the submissions are done;
	// each batch's callbacks must run once (see checkBatches).
	Batches int
	// Workflows, when positive, also enqueues this many workflows of five
	// dependent jobs over the submission window (see checkWorkflows).
	Workflows int
}

// keyRecord is what the driver knows of one business key.
type keyRecord struct {
	class    *class
	viaTx    bool
	submits  int // accepted submissions
	planned  int
	created  int // accepted submissions that created the job
	errors   int // failed submission tries (retried)
	jobIDs   map[string]bool
	lastErr  string
	accepted bool
	// A Unique scenario's key: its first job (jobIDs then holds the
	// second), whether the second enqueue returned an existing job, when
	// the second was created, and what went wrong on the way, if anything.
	firstID     string
	nextExisted bool
	nextAt      time.Time
	scenarioErr string
}

type submission struct {
	n     int
	key   string
	class *class
	viaTx bool
	gen   int // a Unique scenario's job of the key (order.Gen)
}

type event struct {
	at   time.Duration
	what string
	do   func()
}

type driver struct {
	t           *testing.T
	cfg         soakConfig
	pool        *pgxpool.Pool
	redis       *testenv.RedisServer
	service     *fakeService
	opt         asynq.RedisClientOpt
	client      *tasks.Client
	workerDBURL string
	logDir      string
	log         *slog.Logger
	start       time.Time

	mu   sync.Mutex
	keys map[string]*keyRecord
	plan []submission

	// wmu guards workers and gens: a poison job's victim is started again
	// from the goroutine that saw it exit.
	wmu            sync.Mutex
	workers        []*worker
	gens           []int
	noRespawn      bool // set when the run is over
	deploys        int  // deploys that found no deploy job running
	deployTurns    int  // deploys so far (deployVictim)
	poisonExits    atomic.Int32
	unexpectedExit atomic.Value // string

	schedStart, schedStop time.Time

	batches []string // ids: cfg.Batches of them, then deadlineBatch if any
	// deadlineBatch holds a third of the deadline jobs, whose members all
	// end dead or expired: its callback must still run once.
	deadlineBatch string

	// scenarios are the Unique scenarios' goroutines (submitOne).
	scenarios sync.WaitGroup
	// Enqueues with a Delay past their deadline (one per deadline job):
	// refused with ErrPastDeadline, as they must be, or not (wrong).
	pastDeadlineTries, pastDeadlineRefused int
	pastDeadlineWrong                      []string
}

func soak(t *testing.T, cfg soakConfig) {
	dedicated, pgRestart := os.Getenv(envDatabaseURL), os.Getenv(envPGRestart)
	if pgRestart != "" && dedicated == "" {
		t.Fatalf("%s restarts Postgres: set %s to a dedicated server first (the test database is shared)", envPGRestart, envDatabaseURL)
	}
	if dedicated != "" {
		t.Setenv("KEEL_TEST_DATABASE_URL", dedicated)
	}
	ctx := context.Background()
	// The soak's own connections are bounded as its workers' are: the
	// test database's server is shared with the other packages' tests,
	// and its connection slots run out before its CPU does.
	testenv.Pool(t, schema).Close()
	pool, err := pgxpool.New(ctx, testenv.URL(schema)+testenv.IdlePoolParams+fmt.Sprintf("&pool_max_conns=%d", parentPoolConns))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	if _, err := pool.Exec(ctx, chaosSchema); err != nil {
		t.Fatal(err)
	}
	rs := testenv.StartRedis(t)
	svc := newFakeService()
	defer svc.Close() // after the workers are stopped below
	logDir := os.Getenv(envLogDir)
	if logDir == "" {
		logDir = t.TempDir()
	} else if err := os.MkdirAll(logDir, 0o755); err != nil {
		t.Fatal(err)
	}
	logFile, err := os.Create(filepath.Join(logDir, "parent.log"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { logFile.Close() })
	d := &driver{
		t: t, cfg: cfg, pool: pool, redis: rs, service: svc,
		opt:         asynq.RedisClientOpt{Addr: rs.Addr()},
		workerDBURL: testenv.URL(schema) + testenv.IdlePoolParams + fmt.Sprintf("&pool_max_conns=%d", workerPoolConns),
		logDir:      logDir,
		log:         slog.New(slog.NewTextHandler(logFile, &slog.HandlerOptions{Level: slog.LevelWarn})),
		keys:        map[string]*keyRecord{},
	}
	// go-redis logs every failed dial while Redis is down; keep that in the
	// log file, not in the test output.
	redis.SetLogger(redisLog{d.log})
	d.client, err = tasks.NewClient(tasks.ClientConfig{Redis: d.opt, Pool: pool, Logger: d.log})
	if err != nil {
		t.Fatal(err)
	}
	defer d.client.Close()
	d.makePlan()
	d.openBatches(ctx)

	d.start = time.Now()
	d.workers = make([]*worker, cfg.Workers)
	d.gens = make([]int, cfg.Workers)
	d.wmu.Lock()
	for i := range cfg.Workers {
		d.startSlot(i)
	}
	d.wmu.Unlock()
	// Registered after the Redis and the pool: runs before they go away.
	t.Cleanup(func() {
		for _, w := range d.endWorkers() {
			w.kill()
		}
	})

	bg, stopBG := context.WithCancel(ctx)
	defer stopBG()
	relay, err := outbox.NewRelay(outbox.RelayConfig{Pool: pool, Redis: d.opt, Logger: d.log})
	if err != nil {
		t.Fatal(err)
	}
	defer relay.Close()
	var bgWG sync.WaitGroup
	defer bgWG.Wait()
	defer stopBG() // before the Wait above
	bgWG.Go(func() { _ = relay.Run(bg) })

	sched, err := scheduler.New(scheduler.Config{
		Client:  d.client,
		Entries: []scheduler.Entry{{Name: tickEntry, Spec: "@every 1s", Kind: tickKind.Name()}},
		Kinds:   tasks.NewKinds(tickKind),
		// No tick may be dropped, however late the scheduler runs.
		MaxCatchUp: 1 << 20,
		Logger:     d.log,
	})
	if err != nil {
		t.Fatal(err)
	}
	schedCtx, stopSched := context.WithCancel(bg)
	schedDone := make(chan struct{})
	d.schedStart = time.Now()
	go func() { defer close(schedDone); _ = sched.Run(schedCtx) }()

	subCtx, stopSubs := context.WithDeadline(bg, d.start.Add(cfg.Deadline))
	defer stopSubs()
	subsDone := d.submitAll(subCtx)
	flowsDone := d.submitWorkflows(subCtx)

	for _, ev := range d.events(pgRestart) {
		if !d.sleepUntil(ev.at) {
			break
		}
		d.note(ev.what)
		ev.do()
	}
	<-subsDone
	<-flowsDone
	d.sealBatches(subCtx)
	stopSched()
	<-schedDone
	d.schedStop = time.Now()
	d.note(fmt.Sprintf("submissions done, scheduler stopped (%+v)", sched.Stats()))

	converged := d.converge(d.start.Add(cfg.Deadline)) && d.batchesConverge(d.start.Add(cfg.Deadline)) &&
		d.workflowsConverge(d.start.Add(cfg.Deadline))
	elapsed := time.Since(d.start)
	d.note(fmt.Sprintf("converged=%v after %s", converged, elapsed.Round(time.Second)))

	var stopErrs []string
	for _, w := range d.endWorkers() {
		if err := w.stop(20 * time.Second); err != nil {
			stopErrs = append(stopErrs, err.Error())
		}
	}
	stopBG()
	bgWG.Wait()

	rep := d.check(ctx)
	rep.failures = append(rep.failures, d.checkBatches(ctx)...)
	rep.failures = append(rep.failures, d.checkWorkflows(ctx)...)
	t.Logf("chaos soak: %d jobs, %d workers, %d kills, %d workers killed by poison jobs, %d deploys, %d Redis restarts, runtime %s\n%s",
		cfg.Jobs, cfg.Workers, len(cfg.Kills), d.poisonExits.Load(), len(cfg.Deploys), len(cfg.RedisRestarts), elapsed.Round(time.Second), rep.table)
	t.Logf("worker logs:\n%s", d.logSummary())
	if !converged {
		t.Errorf("not every job reached a terminal state within %s", cfg.Deadline)
	}
	for _, e := range stopErrs {
		t.Errorf("graceful stop: %s", e)
	}
	if races := d.grepLogs("WARNING: DATA RACE"); races > 0 {
		t.Errorf("%d data race reports in the worker logs", races)
	}
	for _, f := range rep.failures {
		t.Error(f)
	}
	if t.Failed() {
		d.dumpLogs()
	}
}

// makePlan lays out the submissions: job n is of class n%7, goes through
// EnqueueTx when (n/2) is odd, and every tenth is submitted again a little
// later (possibly while the first is still in flight).
func (d *driver) makePlan() {
	const dupLag = 37
	var dups []submission
	for n := range d.cfg.Jobs {
		c := classes[n%len(classes)]
		s := submission{n: n, key: fmt.Sprintf("%s-%06d", c.name, n), class: c, viaTx: (n/2)%2 == 1}
		d.keys[s.key] = &keyRecord{class: c, viaTx: s.viaTx, jobIDs: map[string]bool{}}
		d.plan = append(d.plan, s)
		if n%10 == 0 {
			dups = append(dups, s)
		}
		for len(dups) > 0 && dups[0].n+dupLag <= n {
			d.plan = append(d.plan, dups[0])
			dups = dups[1:]
		}
	}
	d.plan = append(d.plan, dups...)
	d.planRare()
	for _, s := range d.plan {
		d.keys[s.key].planned++
	}
}

// planRare spreads the rare classes' jobs evenly over parts of the plan,
// each class on its own grid: poison jobs early, so that the workers they
// kill do not take many deploy jobs (MaxRetry(0)) with them, deploy jobs in
// the second half, where the deploys are.
func (d *driver) planRare() {
	type rare struct {
		at float64 // fraction of the plan
		s  submission
	}
	var rares []rare
	n := d.cfg.Jobs
	add := func(c *class, count int, from, to float64) {
		for i := range count {
			s := submission{n: n, key: fmt.Sprintf("%s-%06d", c.name, n), class: c, viaTx: n%2 == 1}
			n++
			d.keys[s.key] = &keyRecord{class: c, viaTx: s.viaTx, jobIDs: map[string]bool{}}
			rares = append(rares, rare{at: from + (to-from)*(float64(i)+0.5)/float64(count), s: s})
		}
	}
	add(poisonClass, d.cfg.Poison, 0, 0.3)
	add(hungClass, d.cfg.Hung-d.cfg.Hung/2, 0, 1)
	add(hungOnceClass, d.cfg.Hung/2, 0, 1)
	add(deployClass, d.cfg.DeployJobs, 0.5, 1)
	add(deadlineClass, d.cfg.Deadlines-d.cfg.Deadlines/2, 0, 1)
	add(expiringClass, d.cfg.Deadlines/2, 0, 1)
	add(lateCallClass, d.cfg.LateCalls, 0, 1)
	// Their second jobs come seconds after the first: not at the very end.
	add(uniqueCancel, d.cfg.Uniques-d.cfg.Uniques/2, 0, 0.9)
	add(uniqueTimeout, d.cfg.Uniques/2, 0, 0.9)
	add(committedClass, d.cfg.CommittedCuts, 0.5, 1)
	// Long jobs arrive all through the run, and the crash-once jobs while
	// they do, after the poison jobs.
	add(longClass, d.cfg.LongJobs, 0, 1)
	add(crashOnceClass, d.cfg.CrashOnce, 0.3, 0.7)
	sort.SliceStable(rares, func(i, j int) bool { return rares[i].at < rares[j].at })
	plan := make([]submission, 0, len(d.plan)+len(rares))
	for i, s := range d.plan {
		for len(rares) > 0 && rares[0].at*float64(len(d.plan)) <= float64(i) {
			plan = append(plan, rares[0].s)
			rares = rares[1:]
		}
		plan = append(plan, s)
	}
	for _, r := range rares {
		plan = append(plan, r.s)
	}
	d.plan = plan
}

// submitAll paces the plan over SubmitOver through Submitters goroutines.
func (d *driver) submitAll(ctx context.Context) <-chan struct{} {
	ch := make(chan submission)
	done := make(chan struct{})
	var wg sync.WaitGroup
	for range d.cfg.Submitters {
		wg.Go(func() {
			for s := range ch {
				d.submitOne(ctx, s)
			}
		})
	}
	go func() {
		defer func() { close(ch); wg.Wait(); d.scenarios.Wait(); close(done) }()
		interval := d.cfg.SubmitOver / time.Duration(len(d.plan))
		next := time.Now()
		for _, s := range d.plan {
			if wait := time.Until(next); wait > 0 {
				if pause(ctx, wait) != nil {
					return
				}
			}
			next = next.Add(interval)
			select {
			case ch <- s:
			case <-ctx.Done():
				return
			}
		}
	}()
	return done
}

// submitOne submits s until it is accepted, as a producer that must not
// drop an order would.
func (d *driver) submitOne(ctx context.Context, s submission) {
	if s.class.scenario != nil && s.gen == 0 {
		d.scenarios.Go(func() { s.class.scenario(d, ctx, s) })
		return
	}
	if s.class.deadline {
		d.probePastDeadline(ctx, s)
	}
	for try := 0; ; try++ {
		res, err := d.submit(ctx, s)
		d.mu.Lock()
		rec := d.keys[s.key]
		if err == nil {
			rec.accepted = true
			rec.submits++
			rec.jobIDs[res.Job.ID] = true
			if !res.Existed {
				rec.created++
			}
		} else {
			rec.errors++
			rec.lastErr = err.Error()
		}
		d.mu.Unlock()
		if err == nil || ctx.Err() != nil {
			return
		}
		if try%10 == 9 {
			d.note(fmt.Sprintf("submission of %s still refused after %d tries: %v", s.key, try+1, err))
		}
		if pause(ctx, min(100*time.Millisecond<<min(try, 5), 2*time.Second)) != nil {
			return
		}
	}
}

func (d *driver) submit(ctx context.Context, s submission) (*tasks.Result, error) {
	var opts []tasks.Option
	o := order{Key: s.key, N: s.n, Hang: s.class.hang, Gen: s.gen}
	switch {
	case s.class.deadline && s.n%3 == 0 && d.deadlineBatch != "":
		opts = append(opts, tasks.InBatch(d.deadlineBatch))
	case d.cfg.Batches > 0:
		opts = append(opts, tasks.InBatch(d.batches[s.n%d.cfg.Batches]))
	}
	// task is made just before it is enqueued: a deadline job's deadline
	// counts from then.
	task := func() *tasks.Task {
		if !s.class.deadline {
			return s.class.kind.New(o, opts...)
		}
		// Half wait past their deadline (delayed until just before it: the
		// scheduled-task check and the queue make them late), half run
		// and ask for a retry past it.
		o.Due = time.Now().Add(deadlineIn)
		delay := tasks.Delay(0)
		if (s.n/2)%2 == 0 {
			// keel rounds a delayed run time up to a whole second (asynq
			// schedules by seconds) and refuses a deadline not after it.
			runAt := time.Now().Add(deadlineDelay).Truncate(time.Second).Add(time.Second)
			o.Due = runAt.Add(deadlineSlack)
			delay = tasks.Delay(deadlineDelay)
		}
		return s.class.kind.New(o, append(opts, delay, tasks.Deadline(o.Due))...)
	}
	if !s.viaTx {
		return d.client.Enqueue(ctx, task())
	}
	var res *tasks.Result
	err := pgx.BeginFunc(ctx, d.pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `INSERT INTO chaos_orders (business_key) VALUES ($1) ON CONFLICT DO NOTHING`, s.key); err != nil {
			return err
		}
		var err error
		res, err = d.client.EnqueueTx(ctx, tx, task())
		return err
	})
	return res, err
}

// events is the chaos schedule of the run.
func (d *driver) events(pgRestart string) []event {
	var evs []event
	for _, at := range d.cfg.RedisRestarts {
		evs = append(evs, event{at: at, what: "Redis stopped; it comes back empty", do: func() {
			d.redis.Stop()
			time.Sleep(d.cfg.RedisDown)
			d.redis.Start()
			d.note("Redis started again, empty")
		}})
	}
	for i, at := range d.cfg.Kills {
		evs = append(evs, event{at: at, what: "SIGKILL a worker", do: func() {
			w, why := d.victim(i)
			w.kill()
			d.note(fmt.Sprintf("worker %d.%d killed (%s)", w.slot, w.gen, why))
			time.Sleep(500 * time.Millisecond) // down a moment before it is started again
			d.restart(w)
		}})
	}
	for _, at := range d.cfg.Deploys {
		evs = append(evs, event{at: at, what: "SIGTERM a worker (a deploy)", do: func() {
			w, why := d.deployVictim()
			d.note(fmt.Sprintf("worker %d.%d sent SIGTERM (%s)", w.slot, w.gen, why))
			err := w.stop(20 * time.Second)
			switch {
			case poisoned(err):
				d.note(fmt.Sprintf("worker %d.%d was killed by a poison job while it stopped", w.slot, w.gen))
			case err != nil:
				d.t.Errorf("deploy: graceful stop: %v", err)
			default:
				d.note(fmt.Sprintf("worker %d.%d stopped", w.slot, w.gen))
			}
			d.restart(w)
		}})
	}
	if pgRestart != "" {
		evs = append(evs, event{at: d.cfg.PGRestartAt, what: "Postgres restart: " + pgRestart, do: func() {
			out, err := exec.Command("sh", "-c", pgRestart).CombinedOutput()
			if err != nil {
				d.t.Errorf("%s: %v\n%s", envPGRestart, err, out)
			}
			d.note("Postgres restart command returned")
		}})
	}
	sort.SliceStable(evs, func(i, j int) bool { return evs[i].at < evs[j].at })
	return evs
}

// victim picks the worker to kill for kill number i: one in the middle of an
// external call if there is one within a moment, so that runs cut recorded
// steps short — alternately preferring unverified steps (the job is then in
// doubt) and verified ones (Verify decides) — and, among those, the next
// worker in turn. Without a step in flight it is simply the next in turn.
// The worker is marked as stopped on purpose.
func (d *driver) victim(i int) (*worker, string) {
	slot, why := d.pickVictim(i)
	return d.claimWorker(slot), why
}

func (d *driver) pickVictim(i int) (slot int, why string) {
	next := i % d.cfg.Workers
	preferUnverified := i%2 == 0
	deadline := time.Now().Add(3 * time.Second)
	for time.Now().Before(deadline) {
		rows, err := d.pool.Query(context.Background(), `SELECT DISTINCT j.lease_holder, j.kind FROM keel_steps s
			JOIN keel_jobs j ON j.id = s.job_id
			WHERE s.status = 'started' AND j.status = 'running' AND j.lease_until > now()`)
		best, bestScore, bestKind := -1, 4, ""
		if err == nil {
			holders := d.holders()
			for rows.Next() {
				var holder, kind string
				if rows.Scan(&holder, &kind) != nil {
					break
				}
				for s, h := range holders {
					if h != holder {
						continue
					}
					score := 0
					if (kind == unverifiedKind.Name()) != preferUnverified {
						score += 2
					}
					if s != next {
						score++
					}
					if score < bestScore {
						best, bestScore, bestKind = s, score, kind
					}
				}
			}
			rows.Close()
		}
		if best >= 0 {
			return best, "in the middle of a step of " + bestKind
		}
		time.Sleep(20 * time.Millisecond)
	}
	return next, "no step in flight"
}

// deployVictim picks the worker to send SIGTERM. Deploys take turns at
// what they look for first: the worker running the most deploy jobs, or
// one with a deploy-committed job past its commit, so that the deploys cut
// both short (whatever either finds, when what it looks for does not come
// within a moment; the next in turn if nothing does). The worker is marked
// as stopped on purpose.
func (d *driver) deployVictim() (*worker, string) {
	d.deployTurns++
	wantCommitted := d.deployTurns%2 == 0
	// A slow host submits the deploy jobs after the deploy's planned time:
	// it waits for them to come (the event it needs), not for a clock.
	deadline, late := time.Now().Add(3*time.Second), time.Now().Add(90*time.Second)
	fallback, fallbackWhy := -1, ""
	toCome := func() bool { return d.deployJobsToCome() || (wantCommitted && d.committedToCome()) }
	for now := time.Now(); now.Before(deadline) || (now.Before(late) && toCome()); now = time.Now() {
		var holder string
		var deploys, committed int
		// Deploy jobs running, and deploy-committed jobs past their commit
		// (their rows are succeeded by then), on the workers now running.
		holders := d.holders()
		err := d.pool.QueryRow(context.Background(), `SELECT holder, sum(d)::int, sum(c)::int FROM (
				SELECT lease_holder AS holder, count(*) AS d, 0 AS c FROM keel_jobs
				WHERE kind = $1 AND status = 'running' AND lease_until > now() GROUP BY 1
				UNION ALL
				SELECT holder, 0, count(*) FROM chaos_after_commit WHERE NOT done GROUP BY 1) r
			WHERE holder = ANY($2) GROUP BY 1
			ORDER BY CASE WHEN $3 THEN sum(c) ELSE sum(d) END DESC, sum(c) + sum(d) DESC LIMIT 1`,
			deployKind.Name(), holders, wantCommitted).Scan(&holder, &deploys, &committed)
		if err == nil {
			for s, h := range holders {
				if h != holder {
					continue
				}
				why := fmt.Sprintf("running %d deploy jobs and %d deploy-committed ones past their commit", deploys, committed)
				if (wantCommitted && committed > 0) || (!wantCommitted && deploys > 0) {
					return d.claimWorker(s), why
				}
				if fallback < 0 {
					fallback, fallbackWhy = s, why
				}
			}
		}
		if fallback >= 0 && now.After(deadline) && !(wantCommitted && d.committedToCome()) {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if fallback >= 0 {
		return d.claimWorker(fallback), fallbackWhy
	}
	d.deploys++
	return d.claimWorker(d.deploys % d.cfg.Workers), "no deploy job running"
}

// committedToCome reports whether some deploy-committed job has yet to
// pass its commit: not accepted yet, or accepted and not past it.
func (d *driver) committedToCome() bool {
	d.mu.Lock()
	accepted, all := 0, 0
	for _, rec := range d.keys {
		if rec.class == committedClass {
			all++
			if rec.accepted {
				accepted++
			}
		}
	}
	d.mu.Unlock()
	if accepted < all {
		return true
	}
	var passed int
	if err := d.pool.QueryRow(context.Background(), `SELECT count(DISTINCT business_key) FROM chaos_after_commit`).Scan(&passed); err != nil {
		return false
	}
	return passed < accepted
}

// deployJobsToCome reports whether some deploy or deploy-committed jobs
// are not accepted yet.
func (d *driver) deployJobsToCome() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, rec := range d.keys {
		if (rec.class == deployClass || rec.class == committedClass) && !rec.accepted {
			return true
		}
	}
	return false
}

// holders are the lease holder names of the current workers, by slot.
func (d *driver) holders() []string {
	d.wmu.Lock()
	defer d.wmu.Unlock()
	hs := make([]string, len(d.workers))
	for s, w := range d.workers {
		hs[s] = w.holder()
	}
	return hs
}

// claimWorker returns slot's current worker, marked as stopped on purpose
// so that a poison job killing it meanwhile does not start another one.
func (d *driver) claimWorker(slot int) *worker {
	d.wmu.Lock()
	defer d.wmu.Unlock()
	w := d.workers[slot]
	w.expected.Store(true)
	return w
}

// restart starts the next generation of w's slot, unless one is running.
func (d *driver) restart(w *worker) {
	d.wmu.Lock()
	defer d.wmu.Unlock()
	d.restartLocked(w)
}

func (d *driver) restartLocked(w *worker) {
	if d.workers[w.slot] != w || d.noRespawn {
		return
	}
	d.startSlot(w.slot)
	d.note(fmt.Sprintf("worker %d restarted (generation %d)", w.slot, d.gens[w.slot]))
}

// respawn restarts a worker a poison job killed, unless the driver is
// stopping it on purpose anyway (and restarts it itself).
func (d *driver) respawn(w *worker) {
	d.poisonExits.Add(1)
	d.note(fmt.Sprintf("worker %d.%d killed by a poison job", w.slot, w.gen))
	d.wmu.Lock()
	defer d.wmu.Unlock()
	if !w.expected.Load() {
		d.restartLocked(w)
	}
}

// endWorkers stops all respawning and returns the workers still running.
func (d *driver) endWorkers() []*worker {
	d.wmu.Lock()
	defer d.wmu.Unlock()
	d.noRespawn = true
	var ws []*worker
	for i, w := range d.workers {
		if w != nil {
			w.expected.Store(true)
			ws = append(ws, w)
		}
		d.workers[i] = nil
	}
	return ws
}

// startSlot starts the next generation of slot; d.wmu must be held.
func (d *driver) startSlot(slot int) {
	d.gens[slot]++
	w, err := d.startWorker(slot, d.gens[slot])
	if err != nil {
		// Also called from a worker's wait goroutine: the test's own
		// goroutine fails on it.
		d.unexpectedExit.Store(fmt.Sprintf("start worker %d: %v", slot, err))
		return
	}
	d.workers[slot] = w
}

// sleepUntil waits until offset at of the run, failing the test if a
// worker dies on its own meanwhile. It returns false past the deadline.
func (d *driver) sleepUntil(at time.Duration) bool {
	for time.Since(d.start) < at {
		d.failOnUnexpectedExit()
		if time.Since(d.start) > d.cfg.Deadline {
			return false
		}
		time.Sleep(min(250*time.Millisecond, at-time.Since(d.start)+time.Millisecond))
	}
	return true
}

func (d *driver) failOnUnexpectedExit() {
	if msg, ok := d.unexpectedExit.Load().(string); ok {
		d.dumpLogs()
		d.t.Fatal(msg)
	}
}

func (d *driver) note(what string) {
	d.t.Logf("t+%6.1fs  %s", time.Since(d.start).Seconds(), what)
}

// converge waits until every accepted job and every tick is terminal.
func (d *driver) converge(deadline time.Time) bool {
	lastReport := time.Now()
	for {
		d.failOnUnexpectedExit()
		open, missing, which, err := d.openJobs()
		if err == nil && open == 0 && missing == 0 {
			return true
		}
		if time.Now().After(deadline) {
			d.note(fmt.Sprintf("deadline: %d jobs open %v, %d accepted keys without a row (err %v)", open, which, missing, err))
			return false
		}
		if time.Since(lastReport) >= 15*time.Second {
			lastReport = time.Now()
			d.note(fmt.Sprintf("waiting: %d jobs open %v, %d accepted keys without a row%s", open, which, missing, d.describeOpen()))
		}
		time.Sleep(time.Second)
	}
}

// describeOpen details the open jobs when there are only a few: what
// holds a run back is then the question.
func (d *driver) describeOpen() string {
	rows, err := d.pool.Query(context.Background(), `SELECT id, business_key, status, attempts, crashes,
		coalesce(last_holder, ''), coalesce(lease_until::text, ''), published_at IS NOT NULL, updated_at::text
		FROM keel_jobs WHERE kind LIKE 'chaos:%' AND status NOT IN `+terminal+` ORDER BY id LIMIT 4`)
	if err != nil {
		return ""
	}
	defer rows.Close()
	var b strings.Builder
	for rows.Next() {
		var id, key, status, holder, lease, updated string
		var attempts, crashes int
		var published bool
		if rows.Scan(&id, &key, &status, &attempts, &crashes, &holder, &lease, &published, &updated) != nil {
			return b.String()
		}
		fmt.Fprintf(&b, "\n    %s %s: %s, attempts %d, crashes %d, last holder %s, lease until %q, published %v, updated %s",
			id, key, status, attempts, crashes, holder, lease, published, updated)
	}
	return b.String()
}

// terminal are the statuses a job ends in: dead and cancelled jobs of a
// Unique kind's key are moved aside for a newer job, expired ones
// discarded.
const terminal = `('succeeded', 'dead', 'discarded', 'cancelled')`

func isTerminal(status string) bool {
	switch idempotency.Status(status) {
	case idempotency.StatusSucceeded, idempotency.StatusDead, idempotency.StatusDiscarded, idempotency.StatusCancelled:
		return true
	}
	return false
}

// probePastDeadline enqueues a job like s with a Delay past its deadline,
// under a key of its own: it must be refused with ErrPastDeadline (the
// check also finds no row for it).
func (d *driver) probePastDeadline(ctx context.Context, s submission) {
	t := s.class.kind.New(order{Key: s.key + refusedSuffix, N: s.n},
		tasks.Deadline(time.Now().Add(time.Second)), tasks.Delay(2*time.Second))
	_, err := d.client.Enqueue(ctx, t)
	if ctx.Err() != nil {
		return
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	d.pastDeadlineTries++
	if errors.Is(err, idempotency.ErrPastDeadline) {
		d.pastDeadlineRefused++
	} else {
		d.pastDeadlineWrong = append(d.pastDeadlineWrong, fmt.Sprintf("%s: %v", s.key+refusedSuffix, err))
	}
}

// refusedSuffix marks the keys of probePastDeadline's enqueues.
const refusedSuffix = "-refused"

// openJobs counts the jobs not yet terminal (which: by kind and status)
// and the accepted keys without a ledger row.
func (d *driver) openJobs() (open, missing int, which map[string]int, err error) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	rows, err := d.pool.Query(ctx, `SELECT business_key, kind, status FROM keel_jobs WHERE kind LIKE 'chaos:%'`)
	if err != nil {
		return -1, -1, nil, err
	}
	seen := map[string]bool{}
	which = map[string]int{}
	for rows.Next() {
		var key, kind, status string
		if err := rows.Scan(&key, &kind, &status); err != nil {
			return -1, -1, nil, err
		}
		seen[key] = true
		if !isTerminal(status) {
			open++
			which[kind+" "+status]++
		}
	}
	if err := rows.Err(); err != nil {
		return -1, -1, nil, err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	for key, rec := range d.keys {
		if rec.accepted && !seen[key] {
			missing++
		}
	}
	return open, missing, which, nil
}

// logPatterns are worker log lines worth counting in the report.
var logPatterns = []string{
	"lease lost",
	"published again",
	"ledger unavailable",
	"could not record",
	"panicked",
	"WARNING: DATA RACE",
}

func (d *driver) logSummary() string {
	var b strings.Builder
	for _, p := range logPatterns {
		fmt.Fprintf(&b, "  %-22q %d\n", p, d.grepLogs(p))
	}
	return b.String()
}

func (d *driver) grepLogs(pattern string) int {
	files, _ := filepath.Glob(filepath.Join(d.logDir, "worker*.log"))
	n := 0
	for _, f := range files {
		fh, err := os.Open(f)
		if err != nil {
			continue
		}
		sc := bufio.NewScanner(fh)
		sc.Buffer(make([]byte, 0, 64<<10), 4<<20)
		for sc.Scan() {
			if strings.Contains(sc.Text(), pattern) {
				n++
			}
		}
		fh.Close()
	}
	return n
}

// dumpLogs shows the end of every log after a failure.
func (d *driver) dumpLogs() {
	files, _ := filepath.Glob(filepath.Join(d.logDir, "*.log"))
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
		if len(lines) > 40 {
			lines = lines[len(lines)-40:]
		}
		d.t.Logf("--- last lines of %s:\n%s", filepath.Base(f), strings.Join(lines, "\n"))
	}
}

// redisLog sends go-redis's own log lines to the soak's log.
type redisLog struct{ l *slog.Logger }

func (r redisLog) Printf(_ context.Context, format string, v ...any) {
	r.l.Warn(fmt.Sprintf(format, v...), "source", "go-redis")
}
