// Command river compares keel with River (github.com/riverqueue/river) on
// the work both promise to do exactly once: one local database side effect
// per job, committed in the same transaction as the job's completion.
//
//   - keel: jobs enqueued with keel's Client.Enqueue (ledger row + Redis);
//     a keel worker's handler inserts the effect row inside idempotency.InTx,
//     which marks the job succeeded in the same transaction.
//   - River: jobs inserted with InsertManyFast; the worker inserts the effect
//     row and calls river.JobCompleteTx in one transaction.
//
// Both run the same number of jobs against the same Postgres, with the same
// worker count and the same pool size, alternating, and each round is
// checked: exactly one effect row per job, every job completed.
//
// A second comparison, enqueue, times bulk inserts of 1,000 jobs per
// transaction: keel's EnqueueManyTx until a relay has put every job in
// Redis, against River's InsertManyTx (plain and unique by args) and
// InsertManyFastTx until the last commit.
//
// It lives in a module of its own so that River's dependencies stay out of
// keel's.
//
//	cd bench/river && go run .            # or: go -C bench/river run .
//	go -C bench/river run . -jobs 20000 -rounds 3 -json
//	go -C bench/river run . -only enqueue -enqueue-jobs 50000
package main

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"runtime"
	"runtime/debug"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"text/tabwriter"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/bench"
	"github.com/keeljobs/keel/internal/ledger"
	"github.com/keeljobs/keel/migrate"
	"github.com/keeljobs/keel/server"
	"github.com/keeljobs/keel/tasks"
)

// settings are the command's flags.
type settings struct {
	databaseURL   string
	redisAddr     string
	redisDB       int
	jobs          int
	rounds        int
	workers       int
	poolSize      int
	fetchCooldown time.Duration
	fetchPoll     time.Duration
	producers     int
	asJSON        bool
	enqueueJobs   int
	effects       bool
	enqueue       bool
}

func main() {
	var s settings
	flag.StringVar(&s.databaseURL, "database-url", envOr("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/keel?sslmode=disable"),
		"Postgres database; the schemas keel_bench_river_keel and keel_bench_river are dropped and recreated")
	flag.StringVar(&s.redisAddr, "redis-addr", "127.0.0.1:6379", "Redis for keel's queues")
	flag.IntVar(&s.redisDB, "redis-db", 14, "Redis database for keel's queues (its default queue must be empty)")
	flag.IntVar(&s.jobs, "jobs", 10000, "jobs per system per round")
	flag.IntVar(&s.rounds, "rounds", 2, "rounds of each comparison (keel then River); the tables show every round, the ratios are the median round's")
	flag.IntVar(&s.workers, "workers", 50, "keel worker concurrency and River MaxWorkers")
	flag.IntVar(&s.poolSize, "pool", 40, "Postgres pool size of each system")
	flag.DurationVar(&s.fetchCooldown, "fetch-cooldown", river.FetchCooldownMin, "River FetchCooldown (its minimum is 1ms)")
	flag.DurationVar(&s.fetchPoll, "fetch-poll-interval", 20*time.Millisecond, "River FetchPollInterval")
	flag.IntVar(&s.producers, "producers", 16, "goroutines enqueueing keel's jobs before a round (not timed)")
	flag.BoolVar(&s.asJSON, "json", false, "print the report as JSON")
	flag.IntVar(&s.enqueueJobs, "enqueue-jobs", 30000, "jobs per system per round of the enqueue comparison")
	only := flag.String("only", "effects,enqueue", "comparisons to run: effects, enqueue or both")
	flag.Parse()
	for part := range strings.SplitSeq(*only, ",") {
		switch strings.TrimSpace(part) {
		case "effects":
			s.effects = true
		case "enqueue":
			s.enqueue = true
		default:
			fmt.Fprintf(os.Stderr, "bench/river: -only: unknown comparison %q (want effects, enqueue)\n", part)
			os.Exit(2)
		}
	}
	if s.rounds < 1 || s.jobs < 1 || s.enqueueJobs < 1 {
		fmt.Fprintln(os.Stderr, "bench/river: -rounds, -jobs and -enqueue-jobs must be at least 1")
		os.Exit(2)
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	rep, err := run(ctx, s)
	if err == nil || len(rep.Rounds) > 0 || rep.Enqueue != nil && len(rep.Enqueue.Rounds) > 0 {
		if s.asJSON {
			enc := json.NewEncoder(os.Stdout)
			enc.SetIndent("", "  ")
			_ = enc.Encode(rep)
		} else {
			fmt.Print(rep)
		}
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench/river:", err)
		os.Exit(1)
	}
}

func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

// Phase is one system processing the jobs once.
type Phase struct {
	System        string  `json:"system"`
	Jobs          int     `json:"jobs"`
	Seconds       float64 `json:"seconds"`
	JobsPerSecond float64 `json:"jobs_per_second"`
	// Effects is how many effect rows the jobs left, Distinct how many
	// different jobs they name; Completed is how many jobs the system
	// records as done.
	Effects   int `json:"effects"`
	Distinct  int `json:"distinct"`
	Completed int `json:"completed"`
	// CPU per job, in milliseconds, while the jobs ran: this process (the
	// worker), Postgres and Redis (all their processes on this host).
	WorkerCPUms   float64 `json:"worker_cpu_ms_per_job"`
	PostgresCPUms float64 `json:"postgres_cpu_ms_per_job"`
	RedisCPUms    float64 `json:"redis_cpu_ms_per_job"`
}

// meter measures CPU time while a phase runs.
type meter struct {
	self, redis, pg time.Duration
	ok              bool
}

func startMeter() meter {
	m := meter{self: bench.ProcessCPU()}
	m.redis, m.pg, m.ok = bench.ServerCPU()
	return m
}

func (m meter) stop(p *Phase) {
	p.WorkerCPUms, p.PostgresCPUms, p.RedisCPUms = m.perJob(p.Jobs)
}

// perJob is the CPU time used since startMeter, in milliseconds per job
// (Postgres and Redis 0 where unknown).
func (m meter) perJob(jobs int) (worker, pg, redis float64) {
	per := func(d time.Duration) float64 { return max(0, float64(d)/float64(time.Millisecond)/float64(jobs)) }
	worker = per(bench.ProcessCPU() - m.self)
	if r, p, ok := bench.ServerCPU(); ok && m.ok {
		redis, pg = per(r-m.redis), per(p-m.pg)
	}
	return worker, pg, redis
}

// Round is keel and River measured one after the other.
type Round struct {
	Keel  Phase   `json:"keel"`
	River Phase   `json:"river"`
	Ratio float64 `json:"ratio"`
}

// Report is the comparison's result.
type Report struct {
	Cores           int     `json:"cores"`
	GoVersion       string  `json:"go"`
	Postgres        string  `json:"postgres"`
	Redis           string  `json:"redis"`
	RiverVersion    string  `json:"river_version"`
	Jobs            int     `json:"jobs"`
	Workers         int     `json:"workers"`
	PoolSize        int     `json:"pool_size"`
	FetchCooldownMs float64 `json:"river_fetch_cooldown_ms"`
	FetchPollMs     float64 `json:"river_fetch_poll_interval_ms"`
	// OtherCores is how many cores, on average over the run, processes
	// other than this one, Redis and Postgres kept busy (-1: unknown here).
	OtherCores float64 `json:"other_cores_busy"`
	// Rounds and Ratio are the effects comparison's (none without it).
	Rounds []Round `json:"rounds"`
	// Ratio is keel's rate over River's in the round with the median ratio.
	Ratio   float64        `json:"ratio"`
	Enqueue *EnqueueReport `json:"enqueue,omitempty"`
}

func (r Report) String() string {
	var sb strings.Builder
	fmt.Fprintf(&sb, "keel vs River: %d cores, %s, Postgres %s, Redis %s, River %s", r.Cores, r.GoVersion, r.Postgres, r.Redis, r.RiverVersion)
	if r.OtherCores >= 0 {
		fmt.Fprintf(&sb, "; other processes kept %.2f of %d cores busy meanwhile", r.OtherCores, r.Cores)
	}
	sb.WriteString("\n\n")
	if len(r.Rounds) > 0 {
		sb.WriteString(r.effectsString())
	}
	if r.Enqueue != nil {
		if len(r.Rounds) > 0 {
			sb.WriteString("\n")
		}
		sb.WriteString(r.Enqueue.String())
	}
	return sb.String()
}

func (r Report) effectsString() string {
	var sb strings.Builder
	fmt.Fprintf(&sb, "exactly-once local effect: %d jobs per system per round; %d workers each, Postgres pool of %d each; River FetchCooldown %gms, FetchPollInterval %gms\n\n",
		r.Jobs, r.Workers, r.PoolSize, r.FetchCooldownMs, r.FetchPollMs)
	tw := tabwriter.NewWriter(&sb, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "round\tsystem\tjobs\tseconds\tjobs/s\tworker cpu ms/job\tpostgres cpu ms/job\tredis cpu ms/job\teffect rows\tdistinct\tcompleted\t")
	for i, rd := range r.Rounds {
		for _, p := range []Phase{rd.Keel, rd.River} {
			fmt.Fprintf(tw, "%d\t%s\t%d\t%.2f\t%.0f\t%.3f\t%.3f\t%.3f\t%d\t%d\t%d\t\n", i+1, p.System, p.Jobs, p.Seconds,
				p.JobsPerSecond, p.WorkerCPUms, p.PostgresCPUms, p.RedisCPUms, p.Effects, p.Distinct, p.Completed)
		}
	}
	tw.Flush()
	fmt.Fprintf(&sb, "\nratio keel/River per round:")
	for _, rd := range r.Rounds {
		fmt.Fprintf(&sb, " %.2f", rd.Ratio)
	}
	fmt.Fprintf(&sb, "\nratio keel/River (median round): %.2f\n", r.Ratio)
	return sb.String()
}

const (
	keelSchema  = "keel_bench_river_keel"
	riverSchema = "keel_bench_river"
	effectKind  = "bench:effect"
	effectQueue = "default"
)

const effectsTable = `CREATE TABLE bench_effects (job_key text NOT NULL, at timestamptz NOT NULL DEFAULT now())`

func run(ctx context.Context, s settings) (rep Report, err error) {
	rep = Report{Cores: runtime.NumCPU(), GoVersion: runtime.Version(), RiverVersion: moduleVersion("github.com/riverqueue/river"),
		Jobs: s.jobs, Workers: s.workers, PoolSize: s.poolSize,
		FetchCooldownMs: float64(s.fetchCooldown) / 1e6, FetchPollMs: float64(s.fetchPoll) / 1e6, OtherCores: -1}
	redisOpt := asynq.RedisClientOpt{Addr: s.redisAddr, DB: s.redisDB}
	if err := emptyQueue(redisOpt, false); err != nil {
		return rep, err
	}
	defer emptyQueue(redisOpt, true) //nolint:errcheck // best effort: leave the database as found
	noise := bench.StartNoise()
	defer func() { rep.OtherCores = noise.Stop() }()
	rep.Postgres, rep.Redis = versions(ctx, s)

	if s.effects {
		if err := effectRates(ctx, s, redisOpt, &rep); err != nil {
			return rep, err
		}
	}
	if s.enqueue {
		enq, err := enqueueRates(ctx, s, redisOpt)
		rep.Enqueue = &enq
		if err != nil {
			return rep, err
		}
	}
	return rep, nil
}

// effectRates runs the effects comparison's rounds into rep.
func effectRates(ctx context.Context, s settings, redisOpt asynq.RedisClientOpt, rep *Report) error {
	for i := range s.rounds {
		fmt.Fprintf(os.Stderr, "round %d of %d: keel…", i+1, s.rounds)
		var rd Round
		var err error
		rd.Keel, err = runKeel(ctx, s, redisOpt)
		if err != nil {
			return fmt.Errorf("keel: %w", err)
		}
		fmt.Fprintf(os.Stderr, " %.0f jobs/s; River…", rd.Keel.JobsPerSecond)
		rd.River, err = runRiver(ctx, s)
		if err != nil {
			return fmt.Errorf("River: %w", err)
		}
		fmt.Fprintf(os.Stderr, " %.0f jobs/s\n", rd.River.JobsPerSecond)
		rd.Ratio = rd.Keel.JobsPerSecond / rd.River.JobsPerSecond
		rep.Rounds = append(rep.Rounds, rd)
	}
	sorted := slices.Clone(rep.Rounds)
	slices.SortFunc(sorted, func(a, b Round) int { return cmp.Compare(a.Ratio, b.Ratio) })
	rep.Ratio = sorted[(len(sorted)-1)/2].Ratio
	return nil
}

// freshPool drops and recreates schema with the effects table in it, and
// returns a pool whose search_path is that schema.
func freshPool(ctx context.Context, s settings, schema string) (*pgxpool.Pool, error) {
	conn, err := pgx.Connect(ctx, s.databaseURL)
	if err != nil {
		return nil, err
	}
	ident := pgx.Identifier{schema}.Sanitize()
	_, err = conn.Exec(ctx, "DROP SCHEMA IF EXISTS "+ident+" CASCADE; CREATE SCHEMA "+ident+"; SET search_path = "+ident+"; "+effectsTable)
	conn.Close(ctx)
	if err != nil {
		return nil, err
	}
	cfg, err := pgxpool.ParseConfig(s.databaseURL)
	if err != nil {
		return nil, err
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	cfg.MaxConns = int32(s.poolSize)
	return pgxpool.NewWithConfig(ctx, cfg)
}

// counter counts committed effects and says when all are in.
type counter struct {
	n    atomic.Int64
	want int64
	all  chan struct{}
}

func newCounter(n int) *counter { return &counter{want: int64(n), all: make(chan struct{})} }

func (c *counter) add() {
	if c.n.Add(1) == c.want {
		close(c.all)
	}
}

func (c *counter) wait(ctx context.Context, stopped <-chan error) error {
	select {
	case <-c.all:
		return nil
	case err := <-stopped:
		return errors.Join(errors.New("worker stopped early"), err)
	case <-ctx.Done():
		return fmt.Errorf("%d of %d effects committed: %w", c.n.Load(), c.want, ctx.Err())
	}
}

func insertEffect(ctx context.Context, tx pgx.Tx, key string) error {
	_, err := tx.Exec(ctx, `INSERT INTO bench_effects (job_key) VALUES ($1)`, key)
	return err
}

// check counts the effect rows and the distinct jobs they name.
func check(ctx context.Context, pool *pgxpool.Pool, p *Phase, completed func(context.Context, *pgxpool.Pool) (int, error)) error {
	if err := pool.QueryRow(ctx, `SELECT count(*), count(DISTINCT job_key) FROM bench_effects`).Scan(&p.Effects, &p.Distinct); err != nil {
		return err
	}
	var err error
	if p.Completed, err = completed(ctx, pool); err != nil {
		return err
	}
	if p.Effects != p.Jobs || p.Distinct != p.Jobs || p.Completed != p.Jobs {
		return fmt.Errorf("%s: %d effect rows for %d distinct jobs, %d completed; want %d of each",
			p.System, p.Effects, p.Distinct, p.Completed, p.Jobs)
	}
	return nil
}

// effect is the payload of both systems' jobs: the key its effect row
// records.
type effect struct {
	Key string `json:"key"`
}

// Kind is River's name for the job kind.
func (effect) Kind() string { return "bench_effect" }

var effectTask = tasks.Define[effect](effectKind, tasks.Queue(effectQueue), tasks.MaxRetry(3),
	tasks.Key(func(e effect) string { return e.Key }))

func runKeel(ctx context.Context, s settings, r asynq.RedisClientOpt) (Phase, error) {
	ph := Phase{System: "keel", Jobs: s.jobs}
	pool, err := freshPool(ctx, s, keelSchema)
	if err != nil {
		return ph, err
	}
	defer pool.Close()
	if _, err := migrate.Up(ctx, pool); err != nil {
		return ph, err
	}
	quiet := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	client, err := tasks.NewClient(tasks.ClientConfig{Redis: r, Pool: pool, Logger: quiet})
	if err != nil {
		return ph, err
	}
	defer client.Close()
	// Enqueue (not timed): ledger rows, published to Redis.
	var next atomic.Int64
	var wg sync.WaitGroup
	errs := make([]error, s.producers)
	for p := range s.producers {
		wg.Go(func() {
			for {
				i := int(next.Add(1)) - 1
				if i >= s.jobs || ctx.Err() != nil {
					return
				}
				if _, err := client.Enqueue(ctx, effectTask.New(effect{Key: fmt.Sprintf("k%08d", i)})); err != nil {
					errs[p] = err
					return
				}
			}
		})
	}
	wg.Wait()
	if err := errors.Join(append(errs, ctx.Err())...); err != nil {
		return ph, err
	}

	done := newCounter(s.jobs)
	mux := tasks.NewMux()
	tasks.Handle(mux, effectTask, func(ctx context.Context, e effect) error {
		err := idempotency.InTx(ctx, func(tx pgx.Tx) error { return insertEffect(ctx, tx, e.Key) })
		if err == nil {
			done.add()
		}
		return err
	})
	srv, err := server.New(server.Config{Redis: r, Pool: pool, Queues: map[string]int{effectQueue: 1},
		Concurrency: s.workers, Logger: quiet}, mux)
	if err != nil {
		return ph, err
	}
	runCtx, stopRun := context.WithCancel(ctx)
	stopped := make(chan error, 1)
	m := startMeter()
	start := time.Now()
	go func() { stopped <- srv.Run(runCtx) }()
	err = done.wait(ctx, stopped)
	ph.Seconds = time.Since(start).Seconds()
	m.stop(&ph)
	stopRun()
	if err != nil {
		return ph, err
	}
	if err := <-stopped; err != nil {
		return ph, err
	}
	ph.JobsPerSecond = float64(s.jobs) / ph.Seconds
	return ph, check(ctx, pool, &ph, func(ctx context.Context, pool *pgxpool.Pool) (int, error) {
		return ledger.SucceededJobs(ctx, pool)
	})
}

// effectWorker is River's side: the effect and the completion in one
// transaction.
type effectWorker struct {
	river.WorkerDefaults[effect]
	pool *pgxpool.Pool
	done *counter
}

func (w *effectWorker) Work(ctx context.Context, job *river.Job[effect]) error {
	tx, err := w.pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // no-op after commit
	if err := insertEffect(ctx, tx, job.Args.Key); err != nil {
		return err
	}
	if _, err := river.JobCompleteTx[*riverpgxv5.Driver](ctx, tx, job); err != nil {
		return err
	}
	if err := tx.Commit(ctx); err != nil {
		return err
	}
	w.done.add()
	return nil
}

func runRiver(ctx context.Context, s settings) (Phase, error) {
	ph := Phase{System: "River", Jobs: s.jobs}
	pool, err := freshPool(ctx, s, riverSchema)
	if err != nil {
		return ph, err
	}
	defer pool.Close()
	driver := riverpgxv5.New(pool)
	migrator, err := rivermigrate.New(driver, &rivermigrate.Config{Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		return ph, err
	}
	if _, err := migrator.Migrate(ctx, rivermigrate.DirectionUp, nil); err != nil {
		return ph, fmt.Errorf("migrate: %w", err)
	}
	done := newCounter(s.jobs)
	workers := river.NewWorkers()
	river.AddWorker(workers, &effectWorker{pool: pool, done: done})
	client, err := river.NewClient(driver, &river.Config{
		Queues:            map[string]river.QueueConfig{river.QueueDefault: {MaxWorkers: s.workers}},
		Workers:           workers,
		FetchCooldown:     s.fetchCooldown,
		FetchPollInterval: s.fetchPoll,
		Logger:            slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})),
	})
	if err != nil {
		return ph, err
	}
	// Insert (not timed).
	params := make([]river.InsertManyParams, s.jobs)
	for i := range params {
		params[i] = river.InsertManyParams{Args: effect{Key: fmt.Sprintf("k%08d", i)}}
	}
	if _, err := client.InsertManyFast(ctx, params); err != nil {
		return ph, fmt.Errorf("insert: %w", err)
	}
	if _, err := pool.Exec(ctx, `ANALYZE river_job`); err != nil {
		return ph, err
	}

	m := startMeter()
	start := time.Now()
	if err := client.Start(ctx); err != nil {
		return ph, err
	}
	err = done.wait(ctx, nil)
	ph.Seconds = time.Since(start).Seconds()
	m.stop(&ph)
	stopCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer cancel()
	err = errors.Join(err, client.Stop(stopCtx))
	if err != nil {
		return ph, err
	}
	ph.JobsPerSecond = float64(s.jobs) / ph.Seconds
	return ph, check(ctx, pool, &ph, func(ctx context.Context, pool *pgxpool.Pool) (int, error) {
		var n int
		err := pool.QueryRow(ctx, `SELECT count(*) FROM river_job WHERE state = 'completed'`).Scan(&n)
		return n, err
	})
}

// emptyQueue refuses (or, with force, empties) a Redis database whose
// default queue holds tasks.
func emptyQueue(r asynq.RedisClientOpt, force bool) error {
	insp := asynq.NewInspector(r)
	defer insp.Close()
	if force {
		err := insp.DeleteQueue(effectQueue, true)
		if errors.Is(err, asynq.ErrQueueNotFound) {
			return nil
		}
		return err
	}
	qs, err := insp.Queues()
	if err != nil {
		return fmt.Errorf("Redis %s db %d: %w", r.Addr, r.DB, err)
	}
	if !slices.Contains(qs, effectQueue) {
		return nil
	}
	info, err := insp.GetQueueInfo(effectQueue)
	switch {
	case err != nil:
		return fmt.Errorf("Redis %s db %d: %w", r.Addr, r.DB, err)
	case info.Size > 0:
		return fmt.Errorf("Redis %s db %d already holds %d tasks in queue %q; give the benchmark an empty database",
			r.Addr, r.DB, info.Size, effectQueue)
	}
	return nil
}

// versions asks the servers for their versions.
func versions(ctx context.Context, s settings) (pg, redisVersion string) {
	pg, redisVersion = "?", "?"
	if conn, err := pgx.Connect(ctx, s.databaseURL); err == nil {
		if conn.QueryRow(ctx, `SHOW server_version`).Scan(&pg) == nil {
			pg, _, _ = strings.Cut(pg, " ")
		}
		conn.Close(ctx)
	}
	rc := redis.NewClient(&redis.Options{Addr: s.redisAddr, DB: s.redisDB})
	defer rc.Close()
	if info, err := rc.Info(ctx, "server").Result(); err == nil {
		for line := range strings.SplitSeq(info, "\n") {
			if v, ok := strings.CutPrefix(strings.TrimSpace(line), "redis_version:"); ok {
				redisVersion = v
			}
		}
	}
	return pg, redisVersion
}

func moduleVersion(path string) string {
	if bi, ok := debug.ReadBuildInfo(); ok {
		for _, m := range bi.Deps {
			if m.Path == path {
				return m.Version
			}
		}
	}
	return "?"
}
