package cli

import (
	"errors"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/keeljobs/keel/scheduler"
	"github.com/keeljobs/keel/tasks"
)

func schedulerCmd(e *Env) *cobra.Command {
	var file, missed string
	var maxCatchUp int
	var anyKind, check bool
	cmd := &cobra.Command{
		Use:   "scheduler",
		Short: "Enqueue cron entries from a schedule file and the ledger (run any number: each tick is one job)",
		Long: `Enqueue the entries of a YAML schedule file (see examples/schedule.yaml), and
those added at run time (keel schedule add), at their ticks, through the ledger.
Run as many copies as you like: each tick has one business key, so it becomes
exactly one job. Without --config it runs the run-time entries alone. Entries
paused with keel schedule pause make no job.

The file is reloaded when it changes and on SIGHUP; a broken file is logged and
the running entries stay. After downtime, missed ticks follow --missed-ticks.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if file == "" && check {
				return usageError{fmt.Errorf("--check needs --config or KEEL_SCHEDULE_FILE (see examples/schedule.yaml)")}
			}
			policy, err := scheduler.ParseMissedTicks(missed)
			if err != nil {
				return usageError{err}
			}
			if maxCatchUp < 0 {
				return usageError{fmt.Errorf("--max-catch-up / KEEL_MAX_CATCH_UP must be a whole number ≥ 0")}
			}
			known := e.app.known
			if anyKind {
				known = scheduler.AnyKind
			}
			// The queues enqueue takes: those KEEL_QUEUES gives the workers too.
			queues, err := enqueueQueues()
			if err != nil {
				return err
			}
			checkEntry := func(en scheduler.Entry) error {
				_, err := entryTask(e.app, en)
				return err
			}
			if check {
				return checkSchedule(cmd, e, file, known, queues)
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
			svc, err := e.Open(ctx)
			if err != nil {
				return err
			}
			defer svc.Close()
			log := svc.Log
			client, err := tasks.NewClient(tasks.ClientConfig{Redis: svc.Redis, Pool: svc.Pool, Logger: log, Queues: queues})
			if err != nil {
				return err
			}
			defer client.Close()
			s, err := scheduler.New(scheduler.Config{
				Client: client, File: file, MissedTicks: policy, MaxCatchUp: maxCatchUp, Kinds: e.app.Kinds, KnownKind: known, Logger: log,
				CheckEntry: checkEntry,
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
	f.BoolVar(&anyKind, "allow-unknown-kinds", envBool(cmd, "KEEL_SCHEDULE_ANY_KIND"),
		"accept kinds this program does not declare, handled by other programs' workers (env KEEL_SCHEDULE_ANY_KIND)")
	f.BoolVar(&check, "check", false, "check the file, print each entry's next ticks and exit (needs no database)")
	return cmd
}

// checkSchedule validates a schedule file without connecting anywhere, for CI
// and for a look at when entries will tick.
// entryTask is a task as en's ticks enqueue it, its payload decoded into
// the kind's type when the program declares the kind.
func entryTask(app App, en scheduler.Entry) (*tasks.Task, error) {
	key := scheduler.TickKey(en.Name, time.Time{})
	if app.Kinds.Known(en.Kind) {
		payload := []byte(en.Payload)
		if len(payload) == 0 {
			payload = []byte("{}")
		}
		// A tick's key is its own, not the one the kind derives.
		return app.Kinds.NewJSON(en.Kind, payload, append(en.Options(), tasks.BusinessKey(key))...)
	}
	return tasks.NewRaw(en.Kind, en.Payload, key, en.Options()...), nil
}

func checkSchedule(cmd *cobra.Command, e *Env, file string, known func(string) bool, queues []string) error {
	entries, err := scheduler.LoadFile(file)
	if err != nil {
		return usageError{err}
	}
	if err := scheduler.ValidateEntries(entries, known); err != nil {
		return usageError{fmt.Errorf("%s: %w", file, err)}
	}
	// What a running scheduler checks with its client, and the payload.
	for i, en := range entries {
		t, err := entryTask(e.app, en)
		if err == nil {
			err = tasks.CheckTasks(queues, t)
		}
		// The entry names the task; the check's own wording (task 0, a
		// tick's key) is not the file's.
		if te := (*tasks.TaskError)(nil); errors.As(err, &te) {
			err = te.Err
		}
		if err != nil {
			return usageError{fmt.Errorf("%s: %w", file, &scheduler.EntryError{Name: en.Name, Index: i + 1, Field: "task", Err: err})}
		}
	}
	type entryJSON struct {
		Name     string      `json:"name"`
		Spec     string      `json:"spec"`
		TimeZone string      `json:"timezone,omitempty"`
		Kind     string      `json:"kind"`
		Next     []time.Time `json:"next_ticks"`
	}
	list := make([]entryJSON, 0, len(entries))
	now := time.Now()
	for _, en := range entries {
		j := entryJSON{Name: en.Name, Spec: en.Spec, TimeZone: en.TimeZone, Kind: en.Kind, Next: []time.Time{}}
		t := now
		for range 3 {
			if t, err = en.Next(t); err != nil || t.IsZero() {
				break
			}
			j.Next = append(j.Next, t.UTC())
		}
		list = append(list, j)
	}
	if e.JSON() {
		return printJSON(cmd.OutOrStdout(), map[string]any{"file": file, "entries": list})
	}
	w := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 4, 2, ' ', 0)
	fmt.Fprintln(w, "ENTRY\tSPEC\tKIND\tNEXT TICKS (UTC)")
	for _, j := range list {
		var next []string
		for _, t := range j.Next {
			next = append(next, t.Format(time.RFC3339))
		}
		spec := j.Spec
		if j.TimeZone != "" {
			spec += " (" + j.TimeZone + ")"
		}
		fmt.Fprintf(w, "%s\t%s\t%s\t%s\n", j.Name, spec, j.Kind, strings.Join(next, ", "))
	}
	if err := w.Flush(); err != nil {
		return err
	}
	fmt.Fprintf(cmd.OutOrStdout(), "%s: %d entries OK\n", file, len(entries))
	return nil
}
