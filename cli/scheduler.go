package main

import (
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	// Declares the example kinds, so schedules naming them pass the kind check.
	_ "github.com/keeljobs/keel/handlers"
	"github.com/keeljobs/keel/scheduler"
	"github.com/keeljobs/keel/tasks"
)

func schedulerCmd(c *conn) *cobra.Command {
	var file, missed string
	var maxCatchUp int
	var anyKind, check bool
	cmd := &cobra.Command{
		Use:   "scheduler",
		Short: "Enqueue cron entries from a schedule file (run any number: each tick is one job)",
		Long: `Enqueue the entries of a YAML schedule file (see examples/schedule.yaml) at
their ticks, through the ledger. Run as many copies as you like: each tick has
one business key, so it becomes exactly one job.

The file is reloaded when it changes and on SIGHUP; a broken file is logged and
the running entries stay. After downtime, missed ticks follow --missed-ticks.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if file == "" {
				return usageError{fmt.Errorf("--config or KEEL_SCHEDULE_FILE is required (see examples/schedule.yaml)")}
			}
			policy, err := scheduler.ParseMissedTicks(missed)
			if err != nil {
				return usageError{err}
			}
			if maxCatchUp < 0 {
				return usageError{fmt.Errorf("--max-catch-up / KEEL_MAX_CATCH_UP must be a whole number ≥ 0")}
			}
			known := tasks.Known
			if anyKind {
				known = scheduler.AnyKind
			}
			if check {
				return checkSchedule(cmd, file, known)
			}
			if policy == scheduler.CatchUp && maxCatchUp == 0 {
				// 0 means "default" in Config; here it was asked for.
				policy = scheduler.Skip
			}
			// Listen before anything slow: SIGHUP's default action kills.
			hup := make(chan os.Signal, 1)
			signal.Notify(hup, syscall.SIGHUP)
			defer signal.Stop(hup)
			ctx := cmd.Context()
			svc, err := c.openService(ctx)
			if err != nil {
				return err
			}
			defer svc.pool.Close()
			redis, pool, log := svc.redis, svc.pool, svc.log
			client, err := tasks.NewClient(tasks.ClientConfig{Redis: redis, Pool: pool, Logger: log})
			if err != nil {
				return err
			}
			defer client.Close()
			s, err := scheduler.New(scheduler.Config{
				Client: client, File: file, MissedTicks: policy, MaxCatchUp: maxCatchUp, KnownKind: known, Logger: log,
			})
			if err != nil {
				return usageError{err}
			}
			go func() {
				for {
					select {
					case <-ctx.Done():
						return
					case <-hup:
						_ = s.Reload() // logs its outcome
					}
				}
			}()
			return s.Run(ctx)
		},
	}
	f := cmd.Flags()
	f.StringVar(&file, "config", os.Getenv("KEEL_SCHEDULE_FILE"), "YAML schedule file (env KEEL_SCHEDULE_FILE)")
	f.StringVar(&missed, "missed-ticks", envOr("KEEL_MISSED_TICKS", "catch-up"),
		"ticks missed while no scheduler ran: catch-up (the --max-catch-up most recent per entry) or skip (env KEEL_MISSED_TICKS)")
	f.IntVar(&maxCatchUp, "max-catch-up", envInt("KEEL_MAX_CATCH_UP", scheduler.DefaultMaxCatchUp),
		"missed ticks per entry caught up at most (env KEEL_MAX_CATCH_UP)")
	f.BoolVar(&anyKind, "allow-unknown-kinds", os.Getenv("KEEL_SCHEDULE_ANY_KIND") == "true",
		"accept kinds this binary does not declare, handled by your own workers (env KEEL_SCHEDULE_ANY_KIND)")
	f.BoolVar(&check, "check", false, "check the file, print each entry's next ticks and exit (needs no database)")
	return cmd
}

// checkSchedule validates a schedule file without connecting anywhere, for CI
// and for a look at when entries will tick.
func checkSchedule(cmd *cobra.Command, file string, known func(string) bool) error {
	entries, err := scheduler.LoadFile(file)
	if err != nil {
		return usageError{err}
	}
	if err := scheduler.ValidateEntries(entries, known); err != nil {
		return usageError{fmt.Errorf("%s: %w", file, err)}
	}
	w := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 4, 2, ' ', 0)
	fmt.Fprintln(w, "ENTRY\tSPEC\tKIND\tNEXT TICKS (UTC)")
	now := time.Now()
	for _, e := range entries {
		var next []string
		t := now
		for range 3 {
			if t, err = e.Next(t); err != nil || t.IsZero() {
				break
			}
			next = append(next, t.UTC().Format(time.RFC3339))
		}
		spec := e.Spec
		if e.TimeZone != "" {
			spec += " (" + e.TimeZone + ")"
		}
		fmt.Fprintf(w, "%s\t%s\t%s\t%s\n", e.Name, spec, e.Kind, strings.Join(next, ", "))
	}
	if err := w.Flush(); err != nil {
		return err
	}
	fmt.Fprintf(cmd.OutOrStdout(), "%s: %d entries OK\n", file, len(entries))
	return nil
}
