package cli

import (
	"fmt"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
)

// keysCmd shows the concurrency keys of a kind (tasks.ConcurrencyKey): per
// key, its jobs in flight and those held for a slot.
func keysCmd(e *Env) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "keys",
		Short: "Concurrency keys (fair shares): each tenant's jobs in flight and held",
	}
	var kind, key string
	var limit int
	ls := &cobra.Command{
		Use:   "ls",
		Short: "List a kind's open concurrency keys, most held first",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if strings.TrimSpace(kind) == "" {
				return usageError{fmt.Errorf("--kind is required")}
			}
			if limit < 1 || limit > 10000 {
				return usageError{fmt.Errorf("--limit must be between 1 and 10000")}
			}
			ctx := cmd.Context()
			ops, _, done, err := e.operator(ctx, false)
			if err != nil {
				return err
			}
			defer done()
			keys, err := ops.ConcurrencyKeys(ctx, kind, key, limit)
			if err != nil {
				return err
			}
			type row struct {
				Key        string     `json:"key"`
				Limit      int        `json:"limit"`
				InFlight   int        `json:"in_flight"`
				Running    int        `json:"running"`
				Held       int        `json:"held"`
				OldestHeld *time.Time `json:"oldest_held_at,omitempty"`
				// OldestHeldSeconds: how long the oldest held job has
				// waited for a slot.
				OldestHeldSeconds float64 `json:"oldest_held_seconds,omitempty"`
			}
			rows := make([]row, 0, len(keys))
			now := time.Now()
			for _, k := range keys {
				r := row{Key: k.Key, Limit: k.Limit, InFlight: k.InFlight, Running: k.Running, Held: k.Held, OldestHeld: k.OldestHeld}
				if k.OldestHeld != nil {
					r.OldestHeldSeconds = now.Sub(*k.OldestHeld).Round(time.Millisecond).Seconds()
				}
				rows = append(rows, r)
			}
			if e.JSON() {
				return printJSON(cmd.OutOrStdout(), rows)
			}
			if len(rows) == 0 {
				fmt.Fprintf(cmd.OutOrStdout(), "kind %s: no key has a job in flight or held\n", oneRow(kind))
				return nil
			}
			tw := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 0, 2, ' ', 0)
			fmt.Fprintln(tw, "KEY\tLIMIT\tIN FLIGHT\tRUNNING\tHELD\tOLDEST HELD")
			for _, r := range rows {
				oldest := "-"
				if r.OldestHeld != nil {
					oldest = fmt.Sprintf("%s ago", time.Duration(r.OldestHeldSeconds*float64(time.Second)).Round(time.Second))
				}
				fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%d\t%s\n", oneRow(r.Key), r.Limit, r.InFlight, r.Running, r.Held, oldest)
			}
			return tw.Flush()
		},
	}
	ls.Flags().StringVar(&kind, "kind", "", "the kind whose keys to list (required)")
	ls.Flags().StringVar(&key, "key", "", "only this concurrency key")
	ls.Flags().IntVar(&limit, "limit", 100, "at most this many keys")
	cmd.AddCommand(ls)
	return cmd
}
