package chaos_test

import (
	"bufio"
	"context"
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
	// PGRestartAt is when KEEL_CHAOS_PG_RESTART_CMD runs, if it is set.
	PGRestartAt time.Duration
	// Deadline bounds the whole run, until every job is terminal.
	Deadline time.Duration
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
}

type submission struct {
	n     int
	key   string
	class *class
	viaTx bool
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
	opt         asynq.RedisClientOpt
	client      *tasks.Client
	workerDBURL string
	logDir      string
	log         *slog.Logger
	start       time.Time

	mu   sync.Mutex
	keys map[string]*keyRecord
	plan []submission

	workers        []*worker
	gens           []int
	unexpectedExit atomic.Value // string

	schedStart, schedStop time.Time
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
	pool := testenv.Pool(t, schema)
	if _, err := pool.Exec(ctx, chaosSchema); err != nil {
		t.Fatal(err)
	}
	rs := testenv.StartRedis(t)
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
		t: t, cfg: cfg, pool: pool, redis: rs,
		opt:         asynq.RedisClientOpt{Addr: rs.Addr()},
		workerDBURL: testenv.URL(schema) + fmt.Sprintf("&pool_max_conns=%d", workerPoolConns),
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

	d.start = time.Now()
	d.workers = make([]*worker, cfg.Workers)
	d.gens = make([]int, cfg.Workers)
	for i := range cfg.Workers {
		d.startSlot(i)
	}
	// Registered after the Redis and the pool: runs before they go away.
	t.Cleanup(func() {
		for _, w := range d.workers {
			if w != nil {
				w.kill()
			}
		}
	})

	bg, stopBG := context.WithCancel(ctx)
	defer stopBG()
	relay := outbox.NewRelay(pool, d.opt, outbox.RelayConfig{Logger: d.log})
	defer relay.Close()
	var bgWG sync.WaitGroup
	defer bgWG.Wait()
	defer stopBG() // before the Wait above
	bgWG.Go(func() { _ = relay.Run(bg) })

	sched, err := scheduler.New(scheduler.Config{
		Client:  d.client,
		Entries: []scheduler.Entry{{Name: tickEntry, Spec: "@every 1s", Kind: tickKind.Name()}},
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

	for _, ev := range d.events(pgRestart) {
		if !d.sleepUntil(ev.at) {
			break
		}
		d.note(ev.what)
		ev.do()
	}
	<-subsDone
	stopSched()
	<-schedDone
	d.schedStop = time.Now()
	d.note(fmt.Sprintf("submissions done, scheduler stopped (%+v)", sched.Stats()))

	converged := d.converge(d.start.Add(cfg.Deadline))
	elapsed := time.Since(d.start)
	d.note(fmt.Sprintf("converged=%v after %s", converged, elapsed.Round(time.Second)))

	var stopErrs []string
	for i, w := range d.workers {
		if err := w.stop(20 * time.Second); err != nil {
			stopErrs = append(stopErrs, err.Error())
		}
		d.workers[i] = nil
	}
	stopBG()
	bgWG.Wait()

	rep := d.check(ctx)
	t.Logf("chaos soak: %d jobs, %d workers, %d kills, %d Redis restarts, runtime %s\n%s",
		cfg.Jobs, cfg.Workers, len(cfg.Kills), len(cfg.RedisRestarts), elapsed.Round(time.Second), rep.table)
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
	for _, s := range d.plan {
		d.keys[s.key].planned++
	}
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
		defer func() { close(ch); wg.Wait(); close(done) }()
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
		if pause(ctx, min(100*time.Millisecond<<min(try, 5), 2*time.Second)) != nil {
			return
		}
	}
}

func (d *driver) submit(ctx context.Context, s submission) (*tasks.Result, error) {
	t := s.class.kind.New(order{Key: s.key, N: s.n})
	if !s.viaTx {
		return d.client.Enqueue(ctx, t)
	}
	var res *tasks.Result
	err := pgx.BeginFunc(ctx, d.pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `INSERT INTO chaos_orders (business_key) VALUES ($1) ON CONFLICT DO NOTHING`, s.key); err != nil {
			return err
		}
		var err error
		res, err = d.client.EnqueueTx(ctx, tx, t)
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
			slot, why := d.victim(i)
			d.workers[slot].kill()
			d.note(fmt.Sprintf("worker %d.%d killed (%s)", slot, d.gens[slot], why))
			time.Sleep(500 * time.Millisecond)
			d.startSlot(slot)
			d.note(fmt.Sprintf("worker %d restarted (generation %d)", slot, d.gens[slot]))
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
func (d *driver) victim(i int) (slot int, why string) {
	next := i % d.cfg.Workers
	preferUnverified := i%2 == 0
	deadline := time.Now().Add(3 * time.Second)
	for time.Now().Before(deadline) {
		rows, err := d.pool.Query(context.Background(), `SELECT DISTINCT j.lease_holder, j.kind FROM keel_steps s
			JOIN keel_jobs j ON j.id = s.job_id
			WHERE s.status = 'started' AND j.status = 'running' AND j.lease_until > now()`)
		best, bestScore, bestKind := -1, 4, ""
		if err == nil {
			for rows.Next() {
				var holder, kind string
				if rows.Scan(&holder, &kind) != nil {
					break
				}
				for s, w := range d.workers {
					if w.holder() != holder {
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

func (d *driver) startSlot(slot int) {
	d.gens[slot]++
	w, err := d.startWorker(slot, d.gens[slot])
	if err != nil {
		d.t.Fatalf("start worker %d: %v", slot, err)
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
		open, missing, err := d.openJobs()
		if err == nil && open == 0 && missing == 0 {
			return true
		}
		if time.Now().After(deadline) {
			d.note(fmt.Sprintf("deadline: %d jobs open, %d accepted keys without a row (err %v)", open, missing, err))
			return false
		}
		if time.Since(lastReport) >= 15*time.Second {
			lastReport = time.Now()
			d.note(fmt.Sprintf("waiting: %d jobs open, %d accepted keys without a row", open, missing))
		}
		time.Sleep(time.Second)
	}
}

func (d *driver) openJobs() (open, missing int, err error) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	rows, err := d.pool.Query(ctx, `SELECT business_key, status FROM keel_jobs WHERE kind LIKE 'chaos:%'`)
	if err != nil {
		return -1, -1, err
	}
	seen := map[string]bool{}
	for rows.Next() {
		var key, status string
		if err := rows.Scan(&key, &status); err != nil {
			return -1, -1, err
		}
		seen[key] = true
		if status != "succeeded" && status != "dead" {
			open++
		}
	}
	if err := rows.Err(); err != nil {
		return -1, -1, err
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	for key, rec := range d.keys {
		if rec.accepted && !seen[key] {
			missing++
		}
	}
	return open, missing, nil
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
