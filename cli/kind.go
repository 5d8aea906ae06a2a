package cli

import (
	"fmt"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/keeljobs/keel/inspect"
)

// kindCmd lists, pauses and resumes kinds. asynq pauses whole queues only:
// a kind's pause holds its jobs in the ledger, so it needs no Redis.
func kindCmd(e *Env) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "kind",
		Short: "List paused kinds, pause one kind on every worker, resume it",
	}
	pause, resume := pauseCommands(e, pausable{noun: "kind", jsonKey: "kind", arg: "KIND",
		pauseShort:  "Stop every worker from starting the kind's jobs (running ones finish); they wait in the ledger as paused",
		resumeShort: "Run the kind's jobs again: those it held go back to the relay, once",
		pause:       (*inspect.Inspector).PauseKind, resume: (*inspect.Inspector).ResumeKind})
	ls := &cobra.Command{
		Use:   "ls",
		Short: "List the paused kinds: who paused each, why, and how many jobs each holds",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx := cmd.Context()
			ops, _, done, err := e.operator(ctx, false)
			if err != nil {
				return err
			}
			defer done()
			pauses, err := ops.PausedKinds(ctx)
			if err != nil {
				return err
			}
			type row struct {
				Kind     string    `json:"kind"`
				PausedBy string    `json:"paused_by"`
				PausedAt time.Time `json:"paused_at"`
				Note     string    `json:"note,omitempty"`
				Held     int64     `json:"held"`
			}
			rows := make([]row, 0, len(pauses))
			for _, p := range pauses {
				rows = append(rows, row{Kind: p.Kind, PausedBy: p.PausedBy, PausedAt: p.PausedAt, Note: p.Note, Held: p.Held})
			}
			if e.JSON() {
				return printJSON(cmd.OutOrStdout(), rows)
			}
			if len(rows) == 0 {
				fmt.Fprintln(cmd.OutOrStdout(), "no kind is paused")
				return nil
			}
			tw := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 0, 2, ' ', 0)
			fmt.Fprintln(tw, "KIND\tHELD\tPAUSED")
			for _, r := range rows {
				paused := fmt.Sprintf("by %s %s", oneRow(r.PausedBy), r.PausedAt.Format(time.RFC3339))
				if r.Note != "" {
					paused += ": " + oneRow(r.Note)
				}
				fmt.Fprintf(tw, "%s\t%d\t%s\n", oneRow(r.Kind), r.Held, paused)
			}
			return tw.Flush()
		},
	}
	cmd.AddCommand(ls, pause, resume)
	return cmd
}
