package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"runtime"
	"strings"
	"sync"
	"time"

	"github.com/hibiken/asynq"
	"github.com/spf13/cobra"

	"github.com/keeljobs/keel/cli"
	"github.com/keeljobs/keel/internal/bench"
)

func benchCmd(env *cli.Env) *cobra.Command {
	var opts bench.Options
	var jsonOut string
	cmd := &cobra.Command{
		Use:   "bench",
		Short: "Measure keel against plain asynq on the same Redis and Postgres, in one run",
		Long: `Measures, each against a baseline taken in the same run:

  processing  no-op jobs per second: a plain asynq worker vs a keel worker
  enqueue     asynq Client.Enqueue vs keel Enqueue vs keel EnqueueTx (one job
              per transaction), one producer and --producers at once
  latency     EnqueueTx commit → handler start on an idle worker (p50/p99)
  relay       how fast relays publish rows committed by EnqueueTx
  recovery    a private redis-server holding 10,000 accepted jobs is
              FLUSHALL'd: how long until the reconciler and a worker ran them,
              with fast settings (1s/1s) and with the defaults
  redelivery  a child worker holding a job is killed with SIGKILL: how long
              until another worker (default settings) starts it (5 kills)
  memory      resident size of a worker process at concurrency 100
  scale       the ledger at scale, only with --only scale (about 12–20 minutes):
              10,000,000 finished and 100,000 open jobs (--scale-finished,
              --scale-open) against a ledger with a hundredth of the finished
              ones: table and index sizes, a keel worker's no-op jobs/s, the
              guard's claim/complete round and EnqueueTx (p50/p99), a
              reconciler pass (time, Go heap), pruning rows/s alone and with
              1,000 jobs/s running, dead tuples, autovacuum and VACUUM. It
              starts a private Postgres (initdb in a temporary directory, run
              as the postgres user when root; autovacuum and fsync on,
              shared_buffers=1GB, max_wal_size=4GB; --scale-pg-setting adds
              settings) and removes it at the end; --scale-database-url uses
              an existing database instead (schema <--schema>_scale, dropped
              at the end)

--only picks parts (default all but scale); a full run takes about three minutes,
--quick about two (redelivery waits out a 10s lease per kill). It needs a Redis database whose critical, default and low
queues are empty (default: database 14 of --redis-url's server; the benchmark
empties those queues between parts) and drops and recreates the Postgres
schema --schema (default keel_bench) in --database-url's database; give it a
database of its own for the cleanest figures. The recovery part starts its
own redis-server (--redis-server) and never flushes the shared one. See
BENCHMARKS.md for what each figure is bounded by.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			redis, err := env.RedisOpt()
			if err != nil {
				return err
			}
			ro, ok := redis.(asynq.RedisClientOpt)
			if !ok {
				return cli.UsageError(fmt.Errorf("keel bench needs a plain redis:// URL"))
			}
			if !cmd.Flags().Changed("redis-url") && os.Getenv("REDIS_URL") == "" {
				ro.DB = 14
			}
			for _, p := range opts.Parts {
				if !isPart(p) {
					return cli.UsageError(fmt.Errorf("--only %q: parts are %s", p, strings.Join(bench.KnownParts(), ",")))
				}
			}
			opts.RedisAddr, opts.RedisDB, opts.RedisPassword = ro.Addr, ro.DB, ro.Password
			opts.DatabaseURL = env.DatabaseURL()
			if err := env.CreateDatabase(cmd.Context()); err != nil {
				return err
			}
			opts.Logger = env.Logger()
			if exe, err := os.Executable(); err == nil {
				opts.WorkerCommand = []string{exe, "bench", "worker"}
			}
			stderr := cmd.ErrOrStderr()
			bar := &progressBar{w: stderr, tty: cli.IsTerminal(stderr)}
			opts.Progress = bar.report
			fmt.Fprintf(stderr, "keel bench: %d cores, %s, redis %s db %d\n", runtime.NumCPU(), runtime.Version(), ro.Addr, ro.DB)
			res, runErr := bench.Run(cmd.Context(), opts)
			bar.clear()
			if jsonOut != "" {
				if err := writeJSON(jsonOut, res); err != nil {
					return err
				}
			}
			if env.JSON() {
				enc := json.NewEncoder(cmd.OutOrStdout())
				enc.SetIndent("", "  ")
				if err := enc.Encode(res); err != nil {
					return err
				}
			} else if len(res.Parts) > 0 {
				fmt.Fprint(cmd.OutOrStdout(), res.String())
			}
			return runErr
		},
	}
	f := cmd.Flags()
	f.StringSliceVar(&opts.Parts, "only", nil, "parts to run, comma-separated: "+strings.Join(bench.KnownParts(), ",")+" (default all but scale)")
	f.BoolVar(&opts.Quick, "quick", false, "every part at small sizes (about 20 seconds)")
	f.IntVar(&opts.Jobs, "jobs", 0, "processing: jobs per worker (default 20,000; 5,000 with --quick)")
	f.IntVar(&opts.Rounds, "rounds", 1, "processing, enqueue and relay: measure this many rounds and report the median round (per row; processing alternates plain/keel)")
	f.IntVar(&opts.Concurrency, "concurrency", 50, "worker concurrency (processing, latency, recovery)")
	f.IntVar(&opts.EnqueueJobs, "enqueue-jobs", 0, "enqueue: jobs per row (default 3,000; 1,000 with --quick)")
	f.IntVar(&opts.Producers, "producers", 16, "enqueue: concurrent producers of the concurrent rows")
	f.IntVar(&opts.LatencySamples, "latency-samples", 0, "latency: jobs per row (default 500; 200 with --quick)")
	f.IntVar(&opts.RelayJobs, "relay-jobs", 0, "relay: committed jobs to publish (default 20,000; 5,000 with --quick)")
	f.IntVar(&opts.RecoveryJobs, "recovery-jobs", 0, "recovery: jobs Redis loses (default 10,000; 3,000 with --quick)")
	f.StringVar(&opts.RedisServer, "redis-server", "redis-server", "recovery: the redis-server program to start privately")
	f.IntVar(&opts.RedeliveryKills, "redelivery-kills", 5, "redelivery: child workers killed")
	f.IntVar(&opts.MemoryJobs, "memory-jobs", 0, "memory: backlog per worker (default 10,000; 3,000 with --quick)")
	f.IntVar(&opts.MemoryConcurrency, "memory-concurrency", 100, "memory: worker concurrency")
	f.IntVar(&opts.ScaleFinished, "scale-finished", 0, "scale: finished jobs in the big ledger (default 10,000,000; 1,000,000 with --quick)")
	f.IntVar(&opts.ScaleOpen, "scale-open", 0, "scale: open jobs in both ledgers (default 100,000; 20,000 with --quick)")
	f.IntVar(&opts.ScaleJobs, "scale-jobs", 0, "scale: no-op jobs a keel worker runs on each ledger (default 20,000; 5,000 with --quick)")
	f.IntVar(&opts.ScaleSamples, "scale-samples", 0, "scale: guard rounds and EnqueueTx calls timed on each ledger (default 2,000; 500 with --quick)")
	f.StringVar(&opts.ScaleDatabaseURL, "scale-database-url", "", "scale: use this database instead of a private Postgres")
	f.StringArrayVar(&opts.ScalePostgresSettings, "scale-pg-setting", nil, "scale: a name=value setting for the private Postgres (repeatable)")
	f.StringVar(&opts.Schema, "schema", "keel_bench", "Postgres schema to (re)create for the benchmark's ledger")
	f.StringVar(&jsonOut, "json-out", "", "also write the results as JSON to this file")
	cmd.AddCommand(benchWorkerCmd())
	return cmd
}

// benchWorkerCmd is the child worker the memory part measures and the
// redelivery part kills.
func benchWorkerCmd() *cobra.Command {
	return &cobra.Command{
		Use:    "worker",
		Short:  "The worker process keel bench's memory and redelivery parts start",
		Hidden: true,
		Args:   cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return bench.ServeWorker(cmd.Context())
		},
	}
}

func isPart(p string) bool {
	for _, q := range bench.KnownParts() {
		if strings.EqualFold(strings.TrimSpace(p), q) {
			return true
		}
	}
	return false
}

func writeJSON(path string, v any) error {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(path, append(b, '\n'), 0o644)
}

// progressBar shows a run's progress: on a terminal, one line redrawn in
// place (finished steps stay above it); otherwise a plain line when each
// step starts and ends.
type progressBar struct {
	mu    sync.Mutex
	w     io.Writer
	tty   bool
	drawn bool // a bar is on the current line
}

func (b *progressBar) report(p bench.Progress) {
	b.mu.Lock()
	defer b.mu.Unlock()
	prefix := fmt.Sprintf("[%d/%d] %s: %s", p.Index, p.Parts, p.Part, p.Step)
	if !b.tty {
		switch {
		case p.Finished:
			fmt.Fprintf(b.w, "%s: done, %d of %d in %s\n", prefix, p.Done, p.Total, p.Elapsed.Round(10*time.Millisecond))
		case p.Done == 0 && p.Elapsed == 0:
			fmt.Fprintf(b.w, "%s: %d…\n", prefix, p.Total)
		}
		return
	}
	if p.Finished {
		fmt.Fprintf(b.w, "\r\x1b[K✓ %s: %d in %s\n", prefix, p.Done, p.Elapsed.Round(10*time.Millisecond))
		b.drawn = false
		return
	}
	const width = 30
	filled := 0
	if p.Total > 0 {
		filled = min(width, p.Done*width/p.Total)
	}
	fmt.Fprintf(b.w, "\r\x1b[K%s [%s%s] %d/%d %s", prefix, strings.Repeat("█", filled), strings.Repeat("░", width-filled),
		p.Done, p.Total, p.Elapsed.Round(100*time.Millisecond))
	b.drawn = true
}

// clear removes an unfinished bar from the terminal.
func (b *progressBar) clear() {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.tty && b.drawn {
		fmt.Fprint(b.w, "\r\x1b[K")
		b.drawn = false
	}
}
