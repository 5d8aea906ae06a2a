package cli

import (
	"encoding/json"
	"fmt"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/keeljobs/keel/inspect"
	"github.com/keeljobs/keel/scheduler"
	"github.com/keeljobs/keel/tasks"
)

// scheduleJSON is a cron entry as `schedule ls --json` prints it.
type scheduleJSON struct {
	Name      string          `json:"name"`
	Source    string          `json:"source"`
	Spec      string          `json:"spec"`
	TimeZone  string          `json:"timezone,omitempty"`
	Kind      string          `json:"kind"`
	Payload   json.RawMessage `json:"payload,omitempty"`
	Queue     string          `json:"queue,omitempty"`
	MaxRetry  *int            `json:"max_retry,omitempty"`
	Timeout   string          `json:"timeout,omitempty"`
	CreatedBy string          `json:"created_by,omitempty"`
	UpdatedBy string          `json:"updated_by,omitempty"`
	UpdatedAt *time.Time      `json:"updated_at,omitempty"`
	SeenAt    *time.Time      `json:"seen_at,omitempty"`
	Running   bool            `json:"running"`
	Paused    *pauseJSON      `json:"paused,omitempty"`
	LastTick  *time.Time      `json:"last_tick,omitempty"`
	NextTick  *time.Time      `json:"next_tick,omitempty"`
	Ticks     []tickJSON      `json:"ticks"`
}

type pauseJSON struct {
	By   string    `json:"by"`
	At   time.Time `json:"at"`
	Note string    `json:"note,omitempty"`
}

type tickJSON struct {
	At     time.Time `json:"at"`
	JobID  string    `json:"job_id,omitempty"`
	Status string    `json:"status,omitempty"`
}

func toScheduleJSON(s inspect.Schedule) scheduleJSON {
	j := scheduleJSON{Name: s.Name, Source: string(s.Source), Spec: s.Spec, TimeZone: s.TimeZone, Kind: s.Kind,
		Payload: s.Payload, Queue: s.Queue, MaxRetry: s.MaxRetry, CreatedBy: s.CreatedBy, UpdatedBy: s.UpdatedBy,
		SeenAt: s.SeenAt, Running: s.Running(time.Now()), LastTick: s.LastTick, NextTick: s.NextTick, Ticks: []tickJSON{}}
	if s.Timeout > 0 {
		j.Timeout = s.Timeout.String()
	}
	if !s.UpdatedAt.IsZero() {
		at := s.UpdatedAt
		j.UpdatedAt = &at
	}
	if p := s.Paused; p != nil {
		j.Paused = &pauseJSON{By: p.PausedBy, At: p.PausedAt, Note: p.Note}
	}
	for _, t := range s.Ticks {
		j.Ticks = append(j.Ticks, tickJSON{At: t.At, JobID: t.JobID, Status: string(t.Status)})
	}
	return j
}

// scheduleCmd lists the cron entries the ledger knows, and adds, changes,
// removes, pauses and resumes them while schedulers run.
func scheduleCmd(e *Env) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "schedule",
		Short: "List cron entries with their last and next tick; add, change, remove, pause and resume them at run time",
		Long: `Cron entries as the ledger knows them: those added at run time (schedule add)
and those running schedulers read from their file or code. Every running
scheduler picks a change up within a couple of seconds. Each change is audited.
A paused entry makes no job until it is resumed; the ticks it skipped are not
caught up.`,
	}
	var actor, note string
	actorNote := func(c *cobra.Command) {
		c.Flags().StringVar(&actor, "actor", defaultActor(), "who is acting (kept in the audit log)")
		c.Flags().StringVar(&note, "note", "", "why (kept in the audit log)")
	}
	check := func() error {
		if strings.TrimSpace(actor) == "" {
			return usageError{inspect.ErrActorRequired}
		}
		return checkNote(note)
	}
	report := func(cmd *cobra.Command, name, action, verb string, changed bool) error {
		if e.JSON() {
			return printJSON(cmd.OutOrStdout(), map[string]any{"entry": name, "action": action, "changed": changed})
		}
		if !changed {
			verb += " already"
		}
		fmt.Fprintf(cmd.OutOrStdout(), "schedule entry %s: %s\n", name, verb)
		return nil
	}

	ls := &cobra.Command{
		Use:   "ls",
		Short: "List every cron entry: where it is defined, its last and next tick, the job its last tick made, who paused it",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx := cmd.Context()
			ops, _, done, err := e.operator(ctx, false)
			if err != nil {
				return err
			}
			defer done()
			all, err := ops.Schedules(ctx)
			if err != nil {
				return err
			}
			if e.JSON() {
				rows := make([]scheduleJSON, 0, len(all))
				for _, s := range all {
					rows = append(rows, toScheduleJSON(s))
				}
				return printJSON(cmd.OutOrStdout(), rows)
			}
			now := time.Now()
			tw := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 0, 2, ' ', 0)
			fmt.Fprintln(tw, "ENTRY\tSOURCE\tSPEC\tKIND\tLAST TICK\tLAST JOB\tNEXT TICK\tPAUSED")
			for _, s := range all {
				spec := s.Spec
				if spec == "" {
					spec = "?"
				} else if s.TimeZone != "" {
					spec += " (" + s.TimeZone + ")"
				}
				last, job, next, paused := "-", "-", "-", "no"
				if s.LastTick != nil {
					last = s.LastTick.UTC().Format(time.RFC3339)
				}
				if len(s.Ticks) > 0 && s.Ticks[0].JobID != "" {
					job = s.Ticks[0].JobID + " (" + string(s.Ticks[0].Status) + ")"
				}
				if s.NextTick != nil {
					next = s.NextTick.UTC().Format(time.RFC3339)
				}
				if p := s.Paused; p != nil {
					paused = fmt.Sprintf("by %s %s", oneRow(p.PausedBy), p.PausedAt.UTC().Format(time.RFC3339))
					if p.Note != "" {
						paused += ": " + oneRow(p.Note)
					}
				}
				source := string(s.Source)
				if !s.Running(now) {
					source += " (no scheduler runs it)"
				}
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", s.Name, source, oneRow(spec), s.Kind, last, job, next, paused)
			}
			return tw.Flush()
		},
	}

	var def struct {
		spec, zone, kind, payload, queue string
		maxRetry                         int
		timeout                          time.Duration
		anyKind                          bool
	}
	// edit adds (or, with set, changes) the entry args[0].
	edit := func(set bool) func(cmd *cobra.Command, args []string) error {
		return func(cmd *cobra.Command, args []string) error {
			if err := check(); err != nil {
				return err
			}
			ctx := cmd.Context()
			ops, _, done, err := e.operator(ctx, false)
			if err != nil {
				return err
			}
			defer done()
			en := inspect.ScheduleEntry{Name: args[0]}
			if set {
				cur, err := ops.Schedule(ctx, args[0])
				if err != nil {
					return err
				}
				if cur.Source != inspect.SourceLedger {
					return fmt.Errorf("%w: %q", inspect.ErrScheduleConfigured, args[0])
				}
				en = cur.ScheduleEntry
			}
			f := cmd.Flags()
			for name, apply := range map[string]func(){
				"spec": func() { en.Spec = def.spec }, "timezone": func() { en.TimeZone = def.zone },
				"kind": func() { en.Kind = def.kind }, "payload": func() { en.Payload = json.RawMessage(def.payload) },
				"queue": func() { en.Queue = def.queue }, "timeout": func() { en.Timeout = def.timeout },
				"max-retry": func() { n := def.maxRetry; en.MaxRetry = &n },
			} {
				if f.Changed(name) {
					apply()
				}
			}
			if !set && (en.Spec == "" || en.Kind == "") {
				return usageError{fmt.Errorf("--spec and --kind are required")}
			}
			// What a scheduler of this program checks before it runs it.
			known := e.app.known
			if def.anyKind {
				known = scheduler.AnyKind
			}
			if err := scheduler.ValidateEntries([]scheduler.Entry{scheduler.Entry(en)}, known); err != nil {
				return usageError{err}
			}
			t, err := entryTask(e.app, scheduler.Entry(en))
			if err == nil {
				queues, qerr := enqueueQueues()
				if qerr != nil {
					return qerr
				}
				err = tasks.CheckTasks(queues, t)
			}
			if err != nil {
				return usageError{&scheduler.EntryError{Name: en.Name, Field: "task", Err: err}}
			}
			if set {
				err = ops.SetSchedule(ctx, en, actor, note)
				if err != nil {
					return err
				}
				return report(cmd, en.Name, "set", "changed", true)
			}
			if err := ops.AddSchedule(ctx, en, actor, note); err != nil {
				return err
			}
			return report(cmd, en.Name, "add", "added", true)
		}
	}
	add := &cobra.Command{
		Use:   "add NAME",
		Short: "Add a cron entry at run time, kept in the ledger; every scheduler runs it",
		Example: `  keel schedule add nightly-report --spec "0 2 * * *" --timezone Europe/Berlin \
    --kind report:nightly --payload '{"format":"pdf"}' --note "finance asked"`,
		Args: cobra.ExactArgs(1),
		RunE: edit(false),
	}
	set := &cobra.Command{
		Use:   "set NAME",
		Short: "Change a run-time cron entry: the flags given replace those fields; a new spec starts it afresh",
		Args:  cobra.ExactArgs(1),
		RunE:  edit(true),
	}
	for _, c := range []*cobra.Command{add, set} {
		f := c.Flags()
		f.StringVar(&def.spec, "spec", "", "cron spec: 5 fields, 6 with seconds first, or @hourly, @every 10m...")
		f.StringVar(&def.zone, "timezone", "", "IANA time zone the spec is read in (default UTC)")
		f.StringVar(&def.kind, "kind", "", "task kind each tick enqueues")
		f.StringVar(&def.payload, "payload", "", "the task's JSON payload (default {})")
		f.StringVar(&def.queue, "queue", "", "queue (default the kind's)")
		f.IntVar(&def.maxRetry, "max-retry", 0, "retry budget (default the kind's)")
		f.DurationVar(&def.timeout, "timeout", 0, "bound on one attempt (default the kind's)")
		f.BoolVar(&def.anyKind, "allow-unknown-kinds", false, "accept a kind this program does not declare, handled by other programs' workers")
		actorNote(c)
	}

	rm := &cobra.Command{
		Use:   "rm NAME",
		Short: "Remove a run-time cron entry; the jobs its ticks made stay",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := check(); err != nil {
				return err
			}
			ctx := cmd.Context()
			ops, _, done, err := e.operator(ctx, false)
			if err != nil {
				return err
			}
			defer done()
			if err := ops.RemoveSchedule(ctx, args[0], actor, note); err != nil {
				return err
			}
			return report(cmd, args[0], "remove", "removed", true)
		},
	}
	actorNote(rm)
	pause, resume := pauseCommands(e, pausable{noun: "schedule entry", jsonKey: "entry", arg: "NAME",
		pauseShort:  "Stop every scheduler from enqueueing the entry's ticks, whatever defines it; kept in the ledger",
		resumeShort: "Let schedulers enqueue the entry's ticks again, from the next one",
		pause:       (*inspect.Inspector).PauseSchedule, resume: (*inspect.Inspector).ResumeSchedule})
	cmd.AddCommand(ls, add, set, rm, pause, resume)
	return cmd
}
