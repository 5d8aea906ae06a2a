// Package bench measures what keel's ledger costs: the processing rate of
// no-op jobs on plain Asynq and on a keel worker (ledger guard and retry
// middleware), one after the other on the same Redis and Postgres, so that
// the ratio between the two is measured under the same conditions.
//
// Processing is what `keel bench` runs; BenchmarkLedgerVsPlain runs it under
// `go test -bench`.
package bench

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"text/tabwriter"
	"time"

	"github.com/google/uuid"
	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/server"
)

// Defaults of Options.
const (
	DefaultJobs        = 20000
	QuickJobs          = 5000
	DefaultConcurrency = 50
	DefaultRedisAddr   = "127.0.0.1:6379"
	DefaultDatabaseURL = "postgres://postgres@127.0.0.1:5432/keel_test?sslmode=disable"
	DefaultSchema      = "keel_bench"
)

// Kind is the task type of the benchmark's jobs.
const Kind = "bench:noop"

// Queue is the queue that holds the benchmark's jobs. The workers read the
// usual weighted queues (critical:6 default:3 low:1); only this one has work.
const Queue = "default"

// Queues are the weighted queues both workers read.
func Queues() map[string]int { return map[string]int{"critical": 6, "default": 3, "low": 1} }

// Options configures Processing.
type Options struct {
	// Jobs is how many no-op jobs each worker processes. Default 20000, or
	// 5000 with Quick.
	Jobs int
	// Quick selects the short run (5000 jobs) when Jobs is not set.
	Quick bool
	// Rounds is how many times to measure both workers, alternating (plain,
	// keel, plain, keel…). The report's figures are those of the round with
	// the median ratio; more rounds make a busy host matter less. Default 1.
	Rounds int
	// Concurrency of both workers. Default 50.
	Concurrency int
	// RedisAddr and RedisDB name the Redis database the queues live in. Its
	// critical, default and low queues must be empty; give the benchmark a
	// database of its own. Default 127.0.0.1:6379, database 0.
	RedisAddr string
	RedisDB   int
	// RedisPassword, if Redis needs one.
	RedisPassword string
	// DatabaseURL is the Postgres database of the ledger. Default the local
	// test database.
	DatabaseURL string
	// Schema is where the benchmark's ledger lives. It is DROPPED and created
	// again on every run. Default keel_bench; "public" is refused.
	Schema string
	// Timeout bounds each phase. Default 60s plus 10ms per job.
	Timeout time.Duration
	// Logger receives progress lines (Info) and the workers' warnings. The
	// workers log at Warn level at most, so logging does not dominate.
	// Default: discard.
	Logger *slog.Logger
}

func (o Options) withDefaults() Options {
	if o.Jobs <= 0 {
		o.Jobs = DefaultJobs
		if o.Quick {
			o.Jobs = QuickJobs
		}
	}
	if o.Concurrency <= 0 {
		o.Concurrency = DefaultConcurrency
	}
	if o.Rounds <= 0 {
		o.Rounds = 1
	}
	if o.RedisAddr == "" {
		o.RedisAddr = DefaultRedisAddr
	}
	if o.DatabaseURL == "" {
		o.DatabaseURL = DefaultDatabaseURL
	}
	if o.Schema == "" {
		o.Schema = DefaultSchema
	}
	if o.Timeout <= 0 {
		o.Timeout = time.Minute + time.Duration(o.Jobs)*10*time.Millisecond
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	return o
}

// Phase is the measurement of one worker.
type Phase struct {
	Name string `json:"name"`
	Jobs int    `json:"jobs"`
	// PrefillSeconds is how long putting the jobs in place took (not part of
	// the rate).
	PrefillSeconds float64 `json:"prefill_seconds"`
	// Seconds is from the worker's start until its queue was empty.
	Seconds       float64 `json:"seconds"`
	JobsPerSecond float64 `json:"jobs_per_second"`
	// CPU per job, in milliseconds, while the worker ran: this process, and
	// (when their processes are visible on this host) Redis and Postgres.
	WorkerCPUms   float64 `json:"worker_cpu_ms_per_job"`
	RedisCPUms    float64 `json:"redis_cpu_ms_per_job,omitempty"`
	PostgresCPUms float64 `json:"postgres_cpu_ms_per_job,omitempty"`
	// OtherCores is how many cores, on average, other processes of the host
	// kept busy meanwhile: a benchmark on a busy host measures the host.
	OtherCores float64 `json:"other_cores_busy,omitempty"`
}

// LedgerCheck is what the keel worker left in the ledger.
type LedgerCheck struct {
	Succeeded         int    `json:"succeeded"`
	NotSucceeded      int    `json:"not_succeeded"`
	Attempts          int    `json:"attempts"`
	Claimed           uint64 `json:"claimed"`
	DuplicatesSkipped uint64 `json:"duplicates_skipped"`
	LeaseBusy         uint64 `json:"lease_busy"`
	LedgerErrors      uint64 `json:"ledger_errors"`
}

// Report is the result of Processing.
type Report struct {
	Jobs        int    `json:"jobs"`
	Concurrency int    `json:"concurrency"`
	Queues      string `json:"queues"`
	Plain       Phase  `json:"plain"`
	Keel        Phase  `json:"keel"`
	// Ratio is keel's rate over plain Asynq's.
	Ratio  float64     `json:"ratio"`
	Ledger LedgerCheck `json:"ledger"`
	// Rounds holds every round when there was more than one; the figures
	// above are those of the round with the median ratio.
	Rounds []Round `json:"rounds,omitempty"`
}

// Round is one measurement of both workers.
type Round struct {
	Plain  Phase       `json:"plain"`
	Keel   Phase       `json:"keel"`
	Ratio  float64     `json:"ratio"`
	Ledger LedgerCheck `json:"ledger"`
}

// String renders the report as a table.
func (r Report) String() string {
	var sb strings.Builder
	fmt.Fprintf(&sb, "no-op jobs: %d per worker, concurrency %d, queues %s (only %s has work)\n\n",
		r.Jobs, r.Concurrency, r.Queues, Queue)
	tw := tabwriter.NewWriter(&sb, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "worker\tjobs\tprefill s\tseconds\tjobs/s\tworker cpu ms/job\tredis cpu ms/job\tpostgres cpu ms/job\tother cores busy\t")
	servers := r.Plain.RedisCPUms+r.Keel.RedisCPUms > 0
	for _, p := range []Phase{r.Plain, r.Keel} {
		fmt.Fprintf(tw, "%s\t%d\t%.2f\t%.2f\t%.0f\t%.3f\t%s\t%s\t%s\t\n", p.Name, p.Jobs, p.PrefillSeconds, p.Seconds,
			p.JobsPerSecond, p.WorkerCPUms, optMs(servers, p.RedisCPUms), optMs(servers, p.PostgresCPUms),
			optCores(servers, p.OtherCores))
	}
	tw.Flush()
	if len(r.Rounds) > 1 {
		fmt.Fprintf(&sb, "\n%d rounds, ratio keel/plain (asynq jobs/s, keel jobs/s) per round:", len(r.Rounds))
		for _, rd := range r.Rounds {
			fmt.Fprintf(&sb, " %.2f (%.0f, %.0f)", rd.Ratio, rd.Plain.JobsPerSecond, rd.Keel.JobsPerSecond)
		}
		fmt.Fprintf(&sb, "\nthe table shows the round with the median ratio")
	}
	fmt.Fprintf(&sb, "\nratio keel/plain: %.2f\n", r.Ratio)
	fmt.Fprintf(&sb, "ledger: %d succeeded, %d not, %d attempts; guard: %d claimed, %d duplicates, %d lease busy, %d ledger errors\n",
		r.Ledger.Succeeded, r.Ledger.NotSucceeded, r.Ledger.Attempts, r.Ledger.Claimed, r.Ledger.DuplicatesSkipped,
		r.Ledger.LeaseBusy, r.Ledger.LedgerErrors)
	return sb.String()
}

func optCores(measured bool, v float64) string {
	if !measured {
		return "-"
	}
	return fmt.Sprintf("%.2f", v)
}

func optMs(measured bool, v float64) string {
	if !measured {
		return "-"
	}
	return fmt.Sprintf("%.3f", v)
}

// Processing measures plain Asynq and then keel processing opts.Jobs no-op
// jobs each (opts.Rounds times), and checks that the ledger recorded every
// keel job as succeeded after exactly one attempt. It drops and recreates opts.Schema, and refuses to
// run when the Redis database's queues hold tasks.
func Processing(ctx context.Context, opts Options) (Report, error) {
	o := opts.withDefaults()
	if o.Schema == "public" {
		return Report{}, errors.New("keel bench: refusing to drop schema public; name a schema of the benchmark's own")
	}
	rep := Report{Jobs: o.Jobs, Concurrency: o.Concurrency, Queues: server.FormatQueues(Queues())}
	redisOpt := asynq.RedisClientOpt{Addr: o.RedisAddr, DB: o.RedisDB, Password: o.RedisPassword}
	if err := checkQueuesEmpty(redisOpt); err != nil {
		return rep, err
	}
	pool, err := ledgerPool(ctx, o)
	if err != nil {
		return rep, err
	}
	defer pool.Close()

	for i := range o.Rounds {
		rd, err := round(ctx, o, redisOpt, pool)
		if err != nil {
			if o.Rounds > 1 {
				err = fmt.Errorf("round %d: %w", i+1, err)
			}
			rep.Plain, rep.Keel, rep.Ratio, rep.Ledger = rd.Plain, rd.Keel, rd.Ratio, rd.Ledger
			return rep, err
		}
		rep.Rounds = append(rep.Rounds, rd)
	}
	sorted := slices.Clone(rep.Rounds)
	slices.SortFunc(sorted, func(a, b Round) int { return cmp.Compare(a.Ratio, b.Ratio) })
	med := sorted[(len(sorted)-1)/2]
	rep.Plain, rep.Keel, rep.Ratio, rep.Ledger = med.Plain, med.Keel, med.Ratio, med.Ledger
	if len(rep.Rounds) == 1 {
		rep.Rounds = nil
	}
	return rep, nil
}

func round(ctx context.Context, o Options, redisOpt asynq.RedisClientOpt, pool *pgxpool.Pool) (Round, error) {
	var rd Round
	var err error
	o.Logger.Info("keel bench: plain asynq", "jobs", o.Jobs)
	rd.Plain, err = runPlain(ctx, o, redisOpt)
	if err != nil {
		return rd, fmt.Errorf("keel bench: plain asynq: %w", err)
	}
	o.Logger.Info("keel bench: plain asynq done", "jobs_per_second", int(rd.Plain.JobsPerSecond))

	o.Logger.Info("keel bench: keel", "jobs", o.Jobs)
	rd.Keel, rd.Ledger, err = runKeel(ctx, o, redisOpt, pool)
	if err != nil {
		return rd, fmt.Errorf("keel bench: keel: %w", err)
	}
	o.Logger.Info("keel bench: keel done", "jobs_per_second", int(rd.Keel.JobsPerSecond))
	if rd.Plain.JobsPerSecond > 0 {
		rd.Ratio = rd.Keel.JobsPerSecond / rd.Plain.JobsPerSecond
	}
	if rd.Ledger.Succeeded != o.Jobs || rd.Ledger.NotSucceeded != 0 || rd.Ledger.Attempts != o.Jobs {
		return rd, fmt.Errorf("keel bench: ledger check failed: %d of %d jobs succeeded, %d not, %d attempts",
			rd.Ledger.Succeeded, o.Jobs, rd.Ledger.NotSucceeded, rd.Ledger.Attempts)
	}
	return rd, nil
}

func checkQueuesEmpty(r asynq.RedisClientOpt) error {
	insp := asynq.NewInspector(r)
	defer insp.Close()
	qs, err := insp.Queues()
	if err != nil {
		return fmt.Errorf("keel bench: Redis at %s: %w", r.Addr, err)
	}
	for _, q := range qs {
		if _, ours := Queues()[q]; !ours {
			continue
		}
		info, err := insp.GetQueueInfo(q)
		if err != nil {
			return fmt.Errorf("keel bench: queue %s: %w", q, err)
		}
		if info.Size > 0 {
			return fmt.Errorf("keel bench: Redis database %d already holds %d tasks in queue %q; give the benchmark an empty database",
				r.DB, info.Size, q)
		}
	}
	return nil
}

// ledgerPool recreates the schema, migrates the ledger into it and returns a
// pool bound to it.
func ledgerPool(ctx context.Context, o Options) (*pgxpool.Pool, error) {
	conn, err := pgx.Connect(ctx, o.DatabaseURL)
	if err != nil {
		return nil, fmt.Errorf("keel bench: Postgres: %w", err)
	}
	ident := pgx.Identifier{o.Schema}.Sanitize()
	_, err = conn.Exec(ctx, "DROP SCHEMA IF EXISTS "+ident+" CASCADE; CREATE SCHEMA "+ident)
	conn.Close(ctx)
	if err != nil {
		return nil, fmt.Errorf("keel bench: schema %s: %w", o.Schema, err)
	}
	cfg, err := pgxpool.ParseConfig(o.DatabaseURL)
	if err != nil {
		return nil, err
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = o.Schema
	cfg.MaxConns = 20
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, err
	}
	if _, err := idempotency.Migrate(ctx, pool); err != nil {
		pool.Close()
		return nil, fmt.Errorf("keel bench: migrate: %w", err)
	}
	return pool, nil
}

// enqueue puts n tasks into Redis from many goroutines (asynq's client sends
// one script per task; concurrency hides the round trips).
func enqueue(ctx context.Context, r asynq.RedisClientOpt, n int, task func(i int) (*asynq.Task, []asynq.Option)) error {
	c := asynq.NewClient(r)
	defer c.Close()
	const workers = 32
	var next atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := int(next.Add(1)) - 1
				if i >= n || ctx.Err() != nil {
					return
				}
				t, opts := task(i)
				if _, err := c.EnqueueContext(ctx, t, opts...); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	return <-errs
}

var payload = []byte(`{}`)

// counter counts handler runs and says when all jobs have run.
type counter struct {
	n    atomic.Int64
	want int64
	all  chan struct{}
}

func newCounter(want int) *counter { return &counter{want: int64(want), all: make(chan struct{})} }

func (c *counter) ProcessTask(context.Context, *asynq.Task) error {
	if c.n.Add(1) == c.want {
		close(c.all)
	}
	return nil
}

// waitEmpty returns when the queue holds no task any more. It polls Redis
// slowly until the handler has seen every job, then closely.
// A value on stopped means the worker stopped early.
func waitEmpty(ctx context.Context, r asynq.RedisClientOpt, c *counter, stopped <-chan error) error {
	insp := asynq.NewInspector(r)
	defer insp.Close()
	interval := 250 * time.Millisecond
	for {
		select {
		case err := <-stopped:
			if err == nil {
				err = errors.New("worker stopped early")
			}
			return err
		case <-ctx.Done():
			return fmt.Errorf("queue %s not empty after %d handler runs: %w", Queue, c.n.Load(), ctx.Err())
		case <-c.all:
			c.all = nil // receive once; nil blocks from now on
			interval = 5 * time.Millisecond
		case <-time.After(interval):
		}
		info, err := insp.GetQueueInfo(Queue)
		if err != nil {
			return err
		}
		if info.Size == 0 && info.Active == 0 {
			return nil
		}
	}
}

func runPlain(ctx context.Context, o Options, r asynq.RedisClientOpt) (Phase, error) {
	ph := Phase{Name: "asynq", Jobs: o.Jobs}
	ctx, cancel := context.WithTimeout(ctx, o.Timeout)
	defer cancel()
	start := time.Now()
	err := enqueue(ctx, r, o.Jobs, func(int) (*asynq.Task, []asynq.Option) {
		return asynq.NewTask(Kind, payload), []asynq.Option{asynq.Queue(Queue)}
	})
	if err != nil {
		return ph, fmt.Errorf("enqueue: %w", err)
	}
	ph.PrefillSeconds = time.Since(start).Seconds()

	srv := asynq.NewServer(r, asynq.Config{
		Concurrency: o.Concurrency,
		Queues:      Queues(),
		Logger:      quietAsynq{o.Logger},
		LogLevel:    asynq.WarnLevel,
	})
	c := newCounter(o.Jobs)
	m := startMeter()
	start = time.Now()
	if err := srv.Start(c); err != nil {
		return ph, err
	}
	err = waitEmpty(ctx, r, c, nil)
	ph.Seconds = time.Since(start).Seconds()
	m.stop(&ph)
	srv.Shutdown()
	if err != nil {
		return ph, err
	}
	ph.JobsPerSecond = float64(o.Jobs) / ph.Seconds
	return ph, nil
}

func runKeel(ctx context.Context, o Options, r asynq.RedisClientOpt, pool *pgxpool.Pool) (Phase, LedgerCheck, error) {
	ph := Phase{Name: "keel", Jobs: o.Jobs}
	var lc LedgerCheck
	ctx, cancel := context.WithTimeout(ctx, o.Timeout)
	defer cancel()
	const maxRetry = 3
	prefix := "bench-" + uuid.NewString()[:8] + "-"
	id := func(i int) string { return fmt.Sprintf("%s%08d", prefix, i) }

	if _, err := pool.Exec(ctx, `TRUNCATE keel_jobs CASCADE`); err != nil {
		return ph, lc, err
	}
	start := time.Now()
	// The ledger rows, published already: the relay has nothing to do.
	_, err := pool.Exec(ctx, `INSERT INTO keel_jobs (id, kind, business_key, queue, payload, max_retry, published_at)
		SELECT $1 || lpad(i::text, 8, '0'), $2, $1 || lpad(i::text, 8, '0'), $3, $4, $5, now()
		FROM generate_series(0, $6 - 1) AS i`, prefix, Kind, Queue, payload, maxRetry, o.Jobs)
	if err != nil {
		return ph, lc, fmt.Errorf("ledger rows: %w", err)
	}
	if _, err := pool.Exec(ctx, `ANALYZE keel_jobs`); err != nil {
		return ph, lc, err
	}
	err = enqueue(ctx, r, o.Jobs, func(i int) (*asynq.Task, []asynq.Option) {
		jid := id(i)
		t := asynq.NewTaskWithHeaders(Kind, payload, map[string]string{idempotency.HeaderBusinessKey: jid})
		return t, []asynq.Option{asynq.TaskID(jid), asynq.Queue(Queue), asynq.MaxRetry(maxRetry)}
	})
	if err != nil {
		return ph, lc, fmt.Errorf("enqueue: %w", err)
	}
	ph.PrefillSeconds = time.Since(start).Seconds()

	logger := slog.New(levelAtLeast{o.Logger.Handler(), slog.LevelWarn})
	c := newCounter(o.Jobs)
	srv, err := server.New(server.Config{
		Redis:       r,
		Pool:        pool,
		Queues:      Queues(),
		Concurrency: o.Concurrency,
		Logger:      logger,
	}, c)
	if err != nil {
		return ph, lc, err
	}
	runCtx, stop := context.WithCancel(context.Background())
	runDone := make(chan error, 1)
	m := startMeter()
	start = time.Now()
	go func() { runDone <- srv.Run(runCtx) }()
	stopped := make(chan error, 1)
	go func() {
		err := <-runDone
		stopped <- err
		runDone <- err
	}()
	err = waitEmpty(ctx, r, c, stopped)
	ph.Seconds = time.Since(start).Seconds()
	m.stop(&ph)
	stop()
	if rerr := <-runDone; err == nil {
		err = rerr
	}
	if err != nil {
		return ph, lc, err
	}
	ph.JobsPerSecond = float64(o.Jobs) / ph.Seconds

	st := srv.Guard().Stats()
	lc.Claimed, lc.DuplicatesSkipped, lc.LeaseBusy, lc.LedgerErrors = st.Claimed, st.DuplicatesSkipped, st.LeaseBusy, st.LedgerErrors
	err = pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE status = 'succeeded'), count(*) FILTER (WHERE status <> 'succeeded'),
		coalesce(sum(attempts), 0) FROM keel_jobs WHERE kind = $1`, Kind).Scan(&lc.Succeeded, &lc.NotSucceeded, &lc.Attempts)
	return ph, lc, err
}

// levelAtLeast raises a handler's minimum level.
type levelAtLeast struct {
	slog.Handler
	min slog.Level
}

func (h levelAtLeast) Enabled(ctx context.Context, l slog.Level) bool {
	return l >= h.min && h.Handler.Enabled(ctx, l)
}

func (h levelAtLeast) WithAttrs(as []slog.Attr) slog.Handler {
	return levelAtLeast{h.Handler.WithAttrs(as), h.min}
}

func (h levelAtLeast) WithGroup(name string) slog.Handler {
	return levelAtLeast{h.Handler.WithGroup(name), h.min}
}

// quietAsynq routes plain asynq's warnings and errors to the logger.
type quietAsynq struct{ l *slog.Logger }

func (a quietAsynq) Debug(...any)      {}
func (a quietAsynq) Info(...any)       {}
func (a quietAsynq) Warn(args ...any)  { a.l.Warn(fmt.Sprint(args...), "source", "asynq") }
func (a quietAsynq) Error(args ...any) { a.l.Error(fmt.Sprint(args...), "source", "asynq") }
func (a quietAsynq) Fatal(args ...any) { a.l.Error(fmt.Sprint(args...), "source", "asynq") }
