// Package bench is keel's internal benchmark harness, not API: it is run
// through `keel bench` (cmd/keel) and by the module in bench/river, and
// changes with them. It measures what keel costs and what it buys, each
// figure against a baseline measured in the same run on the same Redis and
// Postgres:
//
//   - processing: no-op jobs per second on plain Asynq and on a keel worker;
//   - enqueue: Asynq's Client.Enqueue against keel's Enqueue and EnqueueTx,
//     one producer and many, with per-call percentiles;
//   - latency: from EnqueueTx's commit to the handler's start on an idle
//     worker;
//   - relay: how fast relays publish rows committed by EnqueueTx;
//   - recovery: how long after Redis loses every queued job the reconciler
//     and a worker take to run them all, with fast settings and with the
//     defaults;
//   - redelivery: how long after its worker was killed with SIGKILL a job
//     starts again on another worker, with the defaults;
//   - memory: the resident size of a worker at concurrency 100;
//   - scale (only when named): the ledger with 10 million finished jobs
//     against one with a hundredth of them, on a private Postgres:
//     sizes, the guard's rounds, EnqueueTx, a reconciler pass, pruning
//     and vacuum.
//
// Run runs any of them (`keel bench` calls it); Processing runs the first
// alone, and BenchmarkLedgerVsPlain runs it under `go test -bench`.
package bench

import (
	"cmp"
	"context"
	"errors"
	"fmt"
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

	"github.com/keeljobs/keel/internal/jobstore"
	"github.com/keeljobs/keel/internal/ledger"
	"github.com/keeljobs/keel/migrate"
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

// Options configures Processing and Run.
type Options struct {
	// Jobs is how many no-op jobs each worker processes. Default 20000, or
	// 5000 with Quick.
	Jobs int
	// Quick selects the short run of every part when its size is not set.
	Quick bool
	// Rounds is how many times to measure the processing, enqueue and relay
	// parts; processing alternates the workers (plain, keel, plain, keel…).
	// The report's figures are those of the round with the median ratio (per
	// row, for enqueue and relay); more rounds make a busy host matter
	// less. Default 1.
	Rounds int
	// Concurrency of both workers. Default 50.
	Concurrency int
	// RedisAddr and RedisDB name the Redis database the queues live in. Its
	// critical, default and low queues must be empty; give the benchmark a
	// database of its own: Run empties those queues between parts. Default
	// 127.0.0.1:6379, database 0.
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
	// Logger receives the workers' warnings. The workers log at Warn level
	// at most, so logging does not dominate. Default: discard.
	Logger *slog.Logger
	// Progress, when set, is told what is being measured and how far it
	// has come (see Progress).
	Progress func(Progress)

	// Parts selects what Run measures, in this order: processing, enqueue,
	// latency, relay, recovery, redelivery, memory, scale (see KnownParts).
	// Empty means AllParts, which leaves scale out. Processing ignores it.
	Parts []string
	// EnqueueJobs is how many jobs each enqueue row enqueues. Default 3000,
	// or 1000 with Quick.
	EnqueueJobs int
	// Producers is how many goroutines enqueue at once in the concurrent
	// enqueue rows. Default 16.
	Producers int
	// LatencySamples is how many jobs each latency row commits, one at a
	// time. Default 500, or 200 with Quick.
	LatencySamples int
	// LatencyPause is the mean pause between two of them (each pause is
	// drawn from [½, 1½] of it). Default 10ms.
	LatencyPause time.Duration
	// Poll is how long an idle worker waits before it looks at empty queues
	// again (asynq's TaskCheckInterval) for the latency part's keel worker
	// and the asynq worker it is compared with. Default
	// server.DefaultPollingTaskCheckInterval (a polling worker's).
	Poll time.Duration
	// RelayJobs is how many committed rows the relays publish. Default
	// 20000, or 5000 with Quick.
	RelayJobs int
	// RecoveryJobs is how many accepted jobs Redis loses. Default 10000, or
	// 3000 with Quick.
	RecoveryJobs int
	// RecoveryInterval and RecoveryGrace configure the recovery part's
	// first reconciler, which shows how fast republishing itself is.
	// Default 1s each. Its second run always uses the reconciler's defaults.
	RecoveryInterval time.Duration
	RecoveryGrace    time.Duration
	// RedeliveryKills is how many times the redelivery part kills a child
	// worker holding a job. Default 5. It needs WorkerCommand.
	RedeliveryKills int
	// RedisServer is the redis-server program the recovery part starts on
	// a free loopback port (the shared Redis is never flushed). Default
	// "redis-server", looked up in PATH.
	RedisServer string
	// MemoryJobs is the backlog each worker of the memory part processes.
	// Default 10000, or 3000 with Quick.
	MemoryJobs int
	// MemoryConcurrency is the concurrency of those workers. Default 100.
	MemoryConcurrency int
	// ScaleFinished is how many finished jobs the scale part's big ledger
	// holds; its baseline ledger holds a hundredth of them. Default
	// 10,000,000, or 1,000,000 with Quick.
	ScaleFinished int
	// ScaleOpen is how many open jobs both ledgers hold. Default 100,000,
	// or 20,000 with Quick.
	ScaleOpen int
	// ScaleJobs is how many no-op jobs a keel worker runs on each ledger.
	// Default 20,000, or 5,000 with Quick.
	ScaleJobs int
	// ScaleSamples is how many guard rounds and EnqueueTx calls are timed
	// on each ledger, one at a time. Default 2,000, or 500 with Quick.
	ScaleSamples int
	// ScaleDatabaseURL points the scale part at a database (where it
	// creates and at the end drops the schema Schema+"_scale"). Default: a
	// private Postgres, initialised in a temporary directory with
	// DefaultScaleSettings and removed at the end.
	ScaleDatabaseURL string
	// ScalePostgresSettings ("name=value") are given to the private
	// Postgres after DefaultScaleSettings.
	ScalePostgresSettings []string
	// ScaleAutovacuumWait bounds how long the scale part waits for a due
	// autovacuum to start after pruning. Default two autovacuum_naptimes
	// and 10s.
	ScaleAutovacuumWait time.Duration
	// WorkerCommand starts this program as a child worker for the memory
	// and redelivery parts, which set WorkerEnv in its environment; the
	// program must then call ServeWorker. Without it the memory part is
	// skipped and the redelivery part fails.
	WorkerCommand []string
}

func (o Options) withDefaults() Options {
	pick := func(v *int, full, quick int) {
		if *v <= 0 {
			*v = full
			if o.Quick {
				*v = quick
			}
		}
	}
	pick(&o.Jobs, DefaultJobs, QuickJobs)
	pick(&o.EnqueueJobs, 3000, 1000)
	pick(&o.LatencySamples, 500, 200)
	pick(&o.RelayJobs, 20000, 5000)
	pick(&o.RecoveryJobs, 10000, 3000)
	pick(&o.MemoryJobs, 10000, 3000)
	pick(&o.ScaleFinished, DefaultScaleFinished, 1_000_000)
	pick(&o.ScaleOpen, DefaultScaleOpen, 20_000)
	pick(&o.ScaleJobs, 20_000, 5000)
	pick(&o.ScaleSamples, 2000, 500)
	if o.Concurrency <= 0 {
		o.Concurrency = DefaultConcurrency
	}
	if o.Producers <= 0 {
		o.Producers = 16
	}
	if o.RedeliveryKills <= 0 {
		o.RedeliveryKills = 5
	}
	if o.MemoryConcurrency <= 0 {
		o.MemoryConcurrency = 100
	}
	if o.LatencyPause <= 0 {
		o.LatencyPause = 10 * time.Millisecond
	}
	if o.Poll <= 0 {
		o.Poll = server.DefaultPollingTaskCheckInterval
	}
	if o.RecoveryInterval <= 0 {
		o.RecoveryInterval = time.Second
	}
	if o.RecoveryGrace <= 0 {
		o.RecoveryGrace = time.Second
	}
	if o.RedisServer == "" {
		o.RedisServer = "redis-server"
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
		o.Logger = slog.New(slog.DiscardHandler)
	}
	return o
}

// timeout bounds a phase of n jobs.
func (o Options) timeout(n int) time.Duration {
	return max(o.Timeout, time.Minute+time.Duration(n)*10*time.Millisecond)
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
	// PostgresWALBytes is the write-ahead log written per job (the whole
	// cluster's, like the CPU figures).
	PostgresWALBytes float64 `json:"postgres_wal_bytes_per_job,omitempty"`
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
	fmt.Fprintln(tw, "worker\tjobs\tprefill s\tseconds\tjobs/s\tworker cpu ms/job\tredis cpu ms/job\tpostgres cpu ms/job\tWAL B/job\tother cores busy\t")
	servers := r.Plain.RedisCPUms+r.Keel.RedisCPUms > 0
	for _, p := range []Phase{r.Plain, r.Keel} {
		wal := "-" // not measured for plain asynq
		if p.PostgresWALBytes > 0 {
			wal = fmt.Sprintf("%.0f", p.PostgresWALBytes)
		}
		fmt.Fprintf(tw, "%s\t%d\t%.2f\t%.2f\t%.0f\t%.3f\t%s\t%s\t%s\t%s\t\n", p.Name, p.Jobs, p.PrefillSeconds, p.Seconds,
			p.JobsPerSecond, p.WorkerCPUms, optMs(servers, p.RedisCPUms), optMs(servers, p.PostgresCPUms),
			wal, optCores(servers, p.OtherCores))
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
// keel job as succeeded after exactly one attempt. It drops and recreates
// opts.Schema, and refuses to run when the Redis database's queues hold
// tasks.
func Processing(ctx context.Context, opts Options) (Report, error) {
	e, err := open(ctx, opts.withDefaults())
	if err != nil {
		return Report{}, err
	}
	defer e.close()
	e.part, e.index, e.parts = PartProcessing, 1, 1
	return e.processing(ctx)
}

func (e *env) processing(ctx context.Context) (Report, error) {
	o := e.o
	rep := Report{Jobs: o.Jobs, Concurrency: o.Concurrency, Queues: server.FormatQueues(Queues())}
	for i := range o.Rounds {
		rd, err := e.round(ctx, i)
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

func (e *env) round(ctx context.Context, i int) (Round, error) {
	var rd Round
	var err error
	suffix := ""
	if e.o.Rounds > 1 {
		suffix = fmt.Sprintf(" (round %d of %d)", i+1, e.o.Rounds)
	}
	rd.Plain, err = e.runPlain(ctx, "asynq worker"+suffix)
	if err != nil {
		return rd, fmt.Errorf("keel bench: plain asynq: %w", err)
	}
	rd.Keel, rd.Ledger, err = e.runKeel(ctx, "keel worker"+suffix)
	if err != nil {
		return rd, fmt.Errorf("keel bench: keel: %w", err)
	}
	if rd.Plain.JobsPerSecond > 0 {
		rd.Ratio = rd.Keel.JobsPerSecond / rd.Plain.JobsPerSecond
	}
	n := e.o.Jobs
	if rd.Ledger.Succeeded != n || rd.Ledger.NotSucceeded != 0 || rd.Ledger.Attempts != n {
		return rd, fmt.Errorf("keel bench: ledger check failed: %d of %d jobs succeeded, %d not, %d attempts",
			rd.Ledger.Succeeded, n, rd.Ledger.NotSucceeded, rd.Ledger.Attempts)
	}
	return rd, nil
}

func checkQueuesEmpty(r asynq.RedisClientOpt) error {
	if err := registerQueues(r); err != nil {
		return err
	}
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
	pool, err := schemaPool(ctx, o.DatabaseURL, o.Schema, 20)
	if err != nil {
		return nil, err
	}
	if _, err := migrate.Up(ctx, pool); err != nil {
		pool.Close()
		return nil, fmt.Errorf("keel bench: migrate: %w", err)
	}
	return pool, nil
}

// schemaPool is a pool of at most maxConns connections whose search_path
// is schema.
func schemaPool(ctx context.Context, url, schema string, maxConns int32) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, err
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	cfg.MaxConns = maxConns
	return pgxpool.NewWithConfig(ctx, cfg)
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
	if err := <-errs; err != nil {
		return err
	}
	return ctx.Err()
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
	c.add()
	return nil
}

func (c *counter) add() {
	if c.n.Add(1) == c.want {
		close(c.all)
	}
}

func (c *counter) done() int { return int(c.n.Load()) }

// waitEmpty returns when the queue holds no task any more. It polls Redis
// slowly until the handler has seen every job, then closely.
// A value on stopped means the worker stopped early.
func waitEmpty(ctx context.Context, r asynq.RedisClientOpt, c *counter, stopped <-chan error) error {
	insp := asynq.NewInspector(r)
	defer insp.Close()
	interval := 250 * time.Millisecond
	all := c.all
	for {
		select {
		case err := <-stopped:
			if err == nil {
				err = errors.New("worker stopped early")
			}
			return err
		case <-ctx.Done():
			return fmt.Errorf("queue %s not empty after %d handler runs: %w", Queue, c.n.Load(), ctx.Err())
		case <-all:
			all = nil // receive once; nil blocks from now on
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

func (e *env) runPlain(ctx context.Context, step string) (Phase, error) {
	o, r := e.o, e.redis
	ph := Phase{Name: "asynq", Jobs: o.Jobs}
	ctx, cancel := context.WithTimeout(ctx, o.Timeout)
	defer cancel()
	start := time.Now()
	err := e.prefillPlain(ctx, r, o.Jobs)
	if err != nil {
		return ph, fmt.Errorf("enqueue: %w", err)
	}
	ph.PrefillSeconds = time.Since(start).Seconds()

	srv := asynq.NewServer(r, asynq.Config{
		Concurrency:       o.Concurrency,
		Queues:            Queues(),
		TaskCheckInterval: o.Poll, // as the keel worker's
		Logger:            quietAsynq{o.Logger},
		LogLevel:          asynq.WarnLevel,
	})
	c := newCounter(o.Jobs)
	finish := e.step(step, o.Jobs, c.done)
	m := startMeter(nil)
	start = time.Now()
	if err := srv.Start(c); err != nil {
		finish()
		return ph, err
	}
	err = waitEmpty(ctx, r, c, nil)
	ph.Seconds = time.Since(start).Seconds()
	m.stop(&ph)
	finish()
	srv.Shutdown()
	if err != nil {
		return ph, err
	}
	ph.JobsPerSecond = float64(o.Jobs) / ph.Seconds
	return ph, nil
}

// prefillPlain puts n no-op tasks into the queue.
func (e *env) prefillPlain(ctx context.Context, r asynq.RedisClientOpt, n int) error {
	return enqueue(ctx, r, n, func(int) (*asynq.Task, []asynq.Option) {
		return asynq.NewTask(Kind, payload), []asynq.Option{asynq.Queue(Queue)}
	})
}

// prefillKeel records n no-op jobs in the ledger as published and puts
// them into Redis, as Enqueue would have, but in bulk: the relay has nothing
// to do. The ledger must not hold jobs of Kind already.
func (e *env) prefillKeel(ctx context.Context, r asynq.RedisClientOpt, n int) error {
	const maxRetry = 3
	prefix := "bench-" + uuid.NewString()[:8] + "-"
	if err := ledger.FillPublished(ctx, e.pool, prefix, Kind, Queue, payload, maxRetry, n); err != nil {
		return fmt.Errorf("ledger rows: %w", err)
	}
	if err := ledger.AnalyzeJobs(ctx, e.pool); err != nil {
		return err
	}
	err := enqueue(ctx, r, n, func(i int) (*asynq.Task, []asynq.Option) {
		jid := fmt.Sprintf("%s%08d", prefix, i)
		t := asynq.NewTaskWithHeaders(Kind, payload, map[string]string{jobstore.HeaderBusinessKey: jid})
		return t, []asynq.Option{asynq.TaskID(jid), asynq.Queue(Queue), asynq.MaxRetry(maxRetry)}
	})
	if err != nil {
		return fmt.Errorf("enqueue: %w", err)
	}
	return nil
}

func (e *env) runKeel(ctx context.Context, step string) (Phase, LedgerCheck, error) {
	o, r, pool := e.o, e.redis, e.pool
	ph := Phase{Name: "keel", Jobs: o.Jobs}
	var lc LedgerCheck
	ctx, cancel := context.WithTimeout(ctx, o.Timeout)
	defer cancel()
	if err := e.truncate(ctx); err != nil {
		return ph, lc, err
	}
	start := time.Now()
	if err := e.prefillKeel(ctx, r, o.Jobs); err != nil {
		return ph, lc, err
	}
	ph.PrefillSeconds = time.Since(start).Seconds()

	c := newCounter(o.Jobs)
	srv, err := server.New(server.Config{
		Redis:       r,
		Pool:        pool,
		Queues:      Queues(),
		Concurrency: o.Concurrency,
		Logger:      e.warn,
	}, c)
	if err != nil {
		return ph, lc, err
	}
	finish := e.step(step, o.Jobs, c.done)
	m := startMeter(pool)
	start = time.Now()
	w := startServer(srv)
	err = waitEmpty(ctx, r, c, w.stopped)
	ph.Seconds = time.Since(start).Seconds()
	m.stop(&ph)
	finish()
	if serr := w.stop(); err == nil {
		err = serr
	}
	if err != nil {
		return ph, lc, err
	}
	ph.JobsPerSecond = float64(o.Jobs) / ph.Seconds

	st := srv.GuardStats()
	lc.Claimed, lc.DuplicatesSkipped, lc.LeaseBusy, lc.LedgerErrors = st.Claimed, st.DuplicatesSkipped, st.LeaseBusy, st.LedgerErrors
	lc, err = ledgerCheck(ctx, pool, lc)
	return ph, lc, err
}

// ledgerCheck fills in what the ledger says of the benchmark's jobs.
func ledgerCheck(ctx context.Context, pool *pgxpool.Pool, lc LedgerCheck) (LedgerCheck, error) {
	var err error
	lc.Succeeded, lc.NotSucceeded, lc.Attempts, err = ledger.KindTally(ctx, pool, Kind)
	return lc, err
}

// running is a keel worker running in the background.
type running struct {
	cancel  context.CancelFunc
	done    chan error // Run's result, once
	stopped chan error // a copy of it, for waiters that watch for an early stop
}

func startServer(srv *server.Server) *running {
	ctx, cancel := context.WithCancel(context.Background())
	w := &running{cancel: cancel, done: make(chan error, 1), stopped: make(chan error, 1)}
	go func() {
		err := srv.Run(ctx)
		w.stopped <- err
		w.done <- err
	}()
	return w
}

// stop shuts the worker down and returns Run's error.
func (w *running) stop() error {
	w.cancel()
	return <-w.done
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
