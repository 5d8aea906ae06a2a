package main

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"runtime"

	"github.com/hibiken/asynq"
	"github.com/spf13/cobra"

	"github.com/keeljobs/keel/bench"
)

func benchCmd(c *conn) *cobra.Command {
	var opts bench.Options
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "bench",
		Short: "Measure keel's processing rate against plain asynq on the same Redis, in one run",
		Long: `Runs the same no-op jobs through a plain asynq worker and through a keel worker
(ledger claim, lease and completion for every job), alternating, on the same
Redis and Postgres, and prints both rates and their ratio.

It needs a Redis database whose critical, default and low queues are empty
(default: database 14 of --redis-url's server) and drops and recreates the
Postgres schema --schema (default keel_bench) in --database-url's database.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			redis, err := c.redis()
			if err != nil {
				return err
			}
			ro, ok := redis.(asynq.RedisClientOpt)
			if !ok {
				return usageError{fmt.Errorf("keel bench needs a plain redis:// URL")}
			}
			if !cmd.Flags().Changed("redis-url") && envOr("REDIS_URL", "") == "" {
				ro.DB = 14
			}
			opts.RedisAddr, opts.RedisDB, opts.RedisPassword = ro.Addr, ro.DB, ro.Password
			opts.DatabaseURL = c.databaseURL
			if err := c.createDatabase(cmd.Context()); err != nil {
				return err
			}
			log, err := c.logger()
			if err != nil {
				return err
			}
			if !asJSON {
				opts.Logger = log
			} else {
				opts.Logger = slog.New(slog.DiscardHandler)
			}
			fmt.Fprintf(cmd.ErrOrStderr(), "keel bench: %d cores, %s, redis %s db %d\n", runtime.NumCPU(), runtime.Version(), ro.Addr, ro.DB)
			rep, err := bench.Processing(cmd.Context(), opts)
			if err != nil {
				return err
			}
			if asJSON {
				enc := json.NewEncoder(cmd.OutOrStdout())
				enc.SetIndent("", "  ")
				return enc.Encode(rep)
			}
			fmt.Fprintln(cmd.OutOrStdout(), rep.String())
			return nil
		},
	}
	f := cmd.Flags()
	f.BoolVar(&opts.Quick, "quick", false, "a short run (5,000 jobs per worker)")
	f.IntVar(&opts.Jobs, "jobs", 0, "jobs per worker (default 20,000)")
	f.IntVar(&opts.Rounds, "rounds", 1, "alternate plain/keel this many times and report the median round")
	f.IntVar(&opts.Concurrency, "concurrency", 50, "worker concurrency")
	f.StringVar(&opts.Schema, "schema", "keel_bench", "Postgres schema to (re)create for the benchmark's ledger")
	f.BoolVar(&asJSON, "json", false, "print the report as JSON")
	return cmd
}
