package cli

import (
	"fmt"
	"strings"
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
	var actor, note string
	action := func(resume bool) func(cmd *cobra.Command, args []string) error {
		return func(cmd *cobra.Command, args []string) error {
			if strings.TrimSpace(actor) == "" {
				return usageError{inspect.ErrActorRequired}
			}
			if err := checkNote(note); err != nil {
				return err
			}
			ctx := cmd.Context()
			ops, _, done, err := e.operator(ctx, false)
			if err != nil {
				return err
			}
			defer done()
			verb, changed := "paused", false
			if resume {
				verb = "resumed"
				changed, err = ops.ResumeKind(ctx, args[0], actor, note)
			} else {
				changed, err = ops.PauseKind(ctx, args[0], actor, note)
			}
			if err != nil {
				return err
			}
			if e.JSON() {
				return printJSON(cmd.OutOrStdout(), map[string]any{"kind": args[0], "action": strings.TrimSuffix(verb, "d"), "changed": changed})
			}
			if changed {
				fmt.Fprintf(cmd.OutOrStdout(), "kind %s: %s\n", oneRow(args[0]), verb)
			} else {
				fmt.Fprintf(cmd.OutOrStdout(), "kind %s: %s already\n", oneRow(args[0]), verb)
			}
			return nil
		}
	}
	pause := &cobra.Command{
		Use:   "pause KIND",
		Short: "Stop every worker from starting the kind's jobs (running ones finish); they wait in the ledger as paused",
		Args:  cobra.ExactArgs(1),
		RunE:  action(false),
	}
	resume := &cobra.Command{
		Use:   "resume KIND",
		Short: "Run the kind's jobs again: those it held go back to the relay, once",
		Args:  cobra.ExactArgs(1),
		RunE:  action(true),
	}
	for _, c := range []*cobra.Command{pause, resume} {
		c.Flags().StringVar(&actor, "actor", defaultActor(), "who is acting (kept in the audit log)")
		c.Flags().StringVar(&note, "note", "", "why (kept in the audit log)")
	}
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
