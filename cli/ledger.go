package cli

import (
	"fmt"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/keeljobs/keel/internal/ledger"
	"github.com/keeljobs/keel/outbox"
)

type ledgerStats struct {
	TotalBytes      int64            `json:"total_bytes"`
	Rows            map[string]int64 `json:"rows_by_status"`
	Unpublished     int64            `json:"unpublished"`
	OldestUnpubSecs float64          `json:"oldest_unpublished_seconds"`
	Prunable        int64            `json:"prunable_now"`
	Pruned24h       int64            `json:"pruned_last_24h"`
	Pruned7d        int64            `json:"pruned_last_7d"`
}

func ledgerCmd(e *Env) *cobra.Command {
	var retention time.Duration
	cmd := &cobra.Command{
		Use:   "ledger",
		Short: "Print the ledger's size, rows by status, relay backlog and prune rate",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if retention <= 0 {
				return usageError{fmt.Errorf("--retention / KEEL_RETENTION must be a positive duration like 720h")}
			}
			ctx := cmd.Context()
			pool, err := e.Ledger(ctx)
			if err != nil {
				return err
			}
			defer pool.Close()
			st := ledgerStats{}
			if st.TotalBytes, err = ledger.LedgerSize(ctx, pool); err != nil {
				return fmt.Errorf("ledger: %w", err)
			}
			if st.Rows, err = ledger.JobsByStatus(ctx, pool); err != nil {
				return err
			}
			unpublished, oldest, err := ledger.RelayBacklog(ctx, pool, nil)
			if err != nil {
				return err
			}
			st.Unpublished, st.OldestUnpubSecs = unpublished, oldest.Seconds()
			// As a worker's reconciler prunes: each kind's policies, then
			// retention; dead letters by their bounds after the notice.
			if st.Prunable, err = ledger.Prunable(ctx, pool, retention, outbox.DefaultDeadDropNotice, nil); err != nil {
				return err
			}
			if st.Pruned24h, st.Pruned7d, err = ledger.Pruned(ctx, pool, nil); err != nil {
				return err
			}
			// Every status, none left out for having no rows.
			for _, s := range ledgerStatuses {
				st.Rows[s] += 0
			}
			if e.JSON() {
				return printJSON(cmd.OutOrStdout(), st)
			}
			tw := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 0, 2, ' ', 0)
			fmt.Fprintf(tw, "size\t%.1f MiB (jobs + steps, with indexes)\n", float64(st.TotalBytes)/(1<<20))
			for _, s := range ledgerStatuses {
				fmt.Fprintf(tw, "%s\t%d\n", s, st.Rows[s])
			}
			fmt.Fprintf(tw, "unpublished\t%d (oldest %s)\n", st.Unpublished, time.Duration(st.OldestUnpubSecs*float64(time.Second)).Round(time.Second))
			fmt.Fprintf(tw, "prunable now\t%d (by each kind's retention, else %s; dead letters past their bounds after notice)\n", st.Prunable, retention)
			fmt.Fprintf(tw, "pruned\t%d in the last 24h, %d in the last 7 days\n", st.Pruned24h, st.Pruned7d)
			return tw.Flush()
		},
	}
	cmd.Flags().DurationVar(&retention, "retention", envDuration("KEEL_RETENTION", 30*24*time.Hour), "retention to count prunable rows against, for kinds and statuses no policy names (keel retention ls)")
	return cmd
}

// ledgerStatuses are the statuses a job can have, in the order of its life.
var ledgerStatuses = []string{"pending", "running", "failed", "succeeded", "dead", "discarded", "cancelled"}
