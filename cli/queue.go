package cli

import (
	"fmt"
	"slices"
	"text/tabwriter"
	"time"

	"github.com/hibiken/asynq"
	"github.com/spf13/cobra"

	"github.com/keeljobs/keel/inspect"
)

// queueCmd lists, pauses and resumes queues; a pause is the ledger's, so
// it outlives a Redis that loses its data.
func queueCmd(e *Env) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "queue",
		Short: "List queues, pause one on every worker, resume it",
	}
	pause, resume := pauseCommands(e, pausable{noun: "queue", jsonKey: "queue", arg: "QUEUE", redis: true,
		pauseShort:  "Stop every worker from starting the queue's jobs (running ones finish); kept in the ledger",
		resumeShort: "Let workers take the queue's jobs again",
		pause:       (*inspect.Inspector).PauseQueue, resume: (*inspect.Inspector).ResumeQueue})
	ls := &cobra.Command{
		Use:   "ls",
		Short: "List the queues: their sizes, and who paused which",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx := cmd.Context()
			ops, _, done, err := e.operator(ctx, true)
			if err != nil {
				return err
			}
			defer done()
			pauses, err := ops.PausedQueues(ctx)
			if err != nil {
				return err
			}
			redisOpt, err := e.Redis(ctx)
			if err != nil {
				return err
			}
			insp := asynq.NewInspector(redisOpt)
			defer insp.Close()
			names, err := insp.Queues()
			if err != nil {
				return err
			}
			byName := map[string]inspect.QueuePause{}
			for _, p := range pauses {
				byName[p.Queue] = p
				if !slices.Contains(names, p.Queue) {
					names = append(names, p.Queue)
				}
			}
			slices.Sort(names)
			type row struct {
				Queue    string     `json:"queue"`
				Paused   bool       `json:"paused"`
				PausedBy string     `json:"paused_by,omitempty"`
				PausedAt *time.Time `json:"paused_at,omitempty"`
				Note     string     `json:"note,omitempty"`
				// RedisOnly: paused in Redis by asynq's own tools, not
				// through keel; a Redis that loses its data forgets it.
				RedisOnly bool `json:"paused_in_redis_only,omitempty"`
				// Held: the queue's jobs keel holds in the ledger, which
				// Redis delivered while it had lost the pause; the resume
				// hands them to the relay.
				Held      int64 `json:"held,omitempty"`
				Pending   int   `json:"pending"`
				Active    int   `json:"active"`
				Scheduled int   `json:"scheduled"`
				Retry     int   `json:"retry"`
			}
			rows := make([]row, 0, len(names))
			for _, q := range names {
				r := row{Queue: q}
				if info, err := insp.GetQueueInfo(q); err == nil {
					r.Paused, r.Pending, r.Active, r.Scheduled, r.Retry = info.Paused, info.Pending, info.Active, info.Scheduled, info.Retry
				}
				if p, ok := byName[q]; ok {
					at := p.PausedAt
					r.PausedBy, r.PausedAt, r.Note, r.Held = p.PausedBy, &at, p.Note, p.Held
				} else if r.Paused {
					r.RedisOnly = true
				}
				rows = append(rows, r)
			}
			if e.JSON() {
				return printJSON(cmd.OutOrStdout(), rows)
			}
			tw := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 0, 2, ' ', 0)
			fmt.Fprintln(tw, "QUEUE\tPENDING\tACTIVE\tSCHEDULED\tRETRY\tPAUSED")
			for _, r := range rows {
				paused := "no"
				switch {
				case r.RedisOnly:
					paused = "in Redis only (not through keel: a Redis that loses its data forgets it)"
				case r.PausedBy != "":
					paused = fmt.Sprintf("by %s %s", oneRow(r.PausedBy), r.PausedAt.Format(time.RFC3339))
					if r.Note != "" {
						paused += ": " + oneRow(r.Note)
					}
					if r.Held > 0 {
						paused += fmt.Sprintf(" (and %d held in the ledger)", r.Held)
					}
				}
				fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%d\t%s\n", oneRow(r.Queue), r.Pending, r.Active, r.Scheduled, r.Retry, paused)
			}
			return tw.Flush()
		},
	}
	cmd.AddCommand(ls, pause, resume)
	return cmd
}
