package cli

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/inspect"
	"github.com/keeljobs/keel/internal/ledger"
)

// retentionCmd lists, sets and unsets kinds' retention policies: how long
// their finished jobs are kept, and how many dead letters.
func retentionCmd(e *Env) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "retention",
		Short: "List, set and unset how long each kind's finished jobs and dead letters are kept",
	}
	var actor, note, status, keep string
	var maxCount int64
	checkWho := func() error {
		if strings.TrimSpace(actor) == "" {
			return usageError{inspect.ErrActorRequired}
		}
		return checkNote(note)
	}
	set := &cobra.Command{
		Use:   "set KIND --status STATUS (--keep DURATION | --max-count N)",
		Short: "Set how long KIND's jobs of STATUS are kept, and how many dead letters (audited; over the kind's code)",
		Example: "  keel retention set order:send_receipt --status succeeded --keep 7d --note 'ledger at 80%'\n" +
			"  keel retention set order:send_receipt --status dead --keep 90d --max-count 100000",
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := checkWho(); err != nil {
				return err
			}
			if keep == "" && maxCount == 0 {
				return usageError{fmt.Errorf("give --keep, --max-count (dead letters) or both")}
			}
			d, err := parseKeep(keep)
			if err != nil {
				return usageError{err}
			}
			p := inspect.RetentionPolicy{Kind: args[0], Status: status, Keep: d, MaxCount: maxCount}
			if err := ledger.ValidatePolicy(p); err != nil {
				return usageError{err}
			}
			ctx := cmd.Context()
			ops, _, done, err := e.operator(ctx, false)
			if err != nil {
				return err
			}
			defer done()
			if err := ops.SetRetention(ctx, p, actor, note); err != nil {
				return err
			}
			if e.JSON() {
				return printJSON(cmd.OutOrStdout(), toPolicyJSON(p, true))
			}
			fmt.Fprintf(cmd.OutOrStdout(), "retention of %s %s jobs: %s\n", oneRow(p.Kind), p.Status, describePolicy(p))
			return nil
		},
	}
	set.Flags().StringVar(&keep, "keep", "", "how long after they finished jobs are kept: a duration (36h, 7d) or forever")
	set.Flags().Int64Var(&maxCount, "max-count", 0, "dead letters only: how many of the kind are kept; the oldest seen ones beyond go")
	unset := &cobra.Command{
		Use:   "unset KIND --status STATUS",
		Short: "Remove the policy a person set: the kind's code, or the worker's --retention, is in force again (audited)",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := checkWho(); err != nil {
				return err
			}
			if !slices.Contains(ledger.PolicyStatuses, status) {
				return usageError{fmt.Errorf("--status must be one of %s", strings.Join(ledger.PolicyStatuses, ", "))}
			}
			ctx := cmd.Context()
			ops, _, done, err := e.operator(ctx, false)
			if err != nil {
				return err
			}
			defer done()
			changed, err := ops.UnsetRetention(ctx, args[0], status, actor, note)
			if err != nil {
				return err
			}
			if e.JSON() {
				return printJSON(cmd.OutOrStdout(), map[string]any{"kind": args[0], "status": status, "action": "unset", "changed": changed})
			}
			if changed {
				fmt.Fprintf(cmd.OutOrStdout(), "retention of %s %s jobs: a person's policy removed\n", oneRow(args[0]), status)
			} else {
				fmt.Fprintf(cmd.OutOrStdout(), "retention of %s %s jobs: no policy a person set\n", oneRow(args[0]), status)
			}
			return nil
		},
	}
	for _, c := range []*cobra.Command{set, unset} {
		c.Flags().StringVar(&status, "status", "", "succeeded, discarded, cancelled or dead")
		c.Flags().StringVar(&actor, "actor", defaultActor(), "who is acting (kept in the audit log)")
		c.Flags().StringVar(&note, "note", "", "why (kept in the audit log)")
	}
	ls := &cobra.Command{
		Use:   "ls",
		Short: "List the retention policies: the one in force per kind and status, who set it, and the code's it overrides",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx := cmd.Context()
			ops, _, done, err := e.operator(ctx, false)
			if err != nil {
				return err
			}
			defer done()
			ps, err := ops.Retention(ctx)
			if err != nil {
				return err
			}
			rows := make([]policyJSON, 0, len(ps))
			for _, p := range ps {
				in, _ := inspect.RetentionInForce(ps, p.Kind, p.Status)
				rows = append(rows, toPolicyJSON(p, in.Source == p.Source))
			}
			if e.JSON() {
				return printJSON(cmd.OutOrStdout(), rows)
			}
			out := cmd.OutOrStdout()
			tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
			fmt.Fprintln(tw, "KIND\tSTATUS\tPOLICY\tSET BY")
			for i, r := range rows {
				by := r.Source
				if r.Source == inspect.SourcePerson {
					by = fmt.Sprintf("%s %s", oneRow(r.SetBy), r.SetAt.Format(time.RFC3339))
					if r.Note != "" {
						by += ": " + oneRow(r.Note)
					}
				} else {
					by = "the kind's code (tasks.Keep)"
				}
				policy := describePolicy(ps[i])
				if !r.InForce {
					policy = "(overridden) " + policy
				}
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\n", oneRow(r.Kind), r.Status, policy, by)
			}
			if err := tw.Flush(); err != nil {
				return err
			}
			fmt.Fprintln(out, "Kinds and statuses not listed: succeeded, discarded and cancelled jobs are kept for the workers' --retention"+
				" (KEEL_RETENTION, default 720h); dead letters for ever.")
			return nil
		},
	}
	cmd.AddCommand(ls, set, unset)
	return cmd
}

// policyJSON is a policy as `retention ls --json` and `set --json` print it.
type policyJSON struct {
	Kind   string `json:"kind"`
	Status string `json:"status"`
	// Source: person or code; InForce: a person's is over the code's.
	Source  string `json:"source"`
	InForce bool   `json:"in_force"`
	// KeepSeconds: 0 is for ever.
	KeepSeconds int64     `json:"keep_seconds"`
	MaxCount    int64     `json:"max_count,omitempty"`
	SetBy       string    `json:"set_by"`
	SetAt       time.Time `json:"set_at"`
	Note        string    `json:"note,omitempty"`
}

func toPolicyJSON(p inspect.RetentionPolicy, inForce bool) policyJSON {
	source := p.Source
	if source == "" {
		source = inspect.SourcePerson
	}
	return policyJSON{Kind: p.Kind, Status: p.Status, Source: source, InForce: inForce, KeepSeconds: int64(p.Keep / time.Second),
		MaxCount: p.MaxCount, SetBy: p.SetBy, SetAt: p.SetAt, Note: p.Note}
}

// describePolicy says a policy in words: "kept 7d", "kept for ever, at
// most 1000 (the oldest seen go)".
func describePolicy(p inspect.RetentionPolicy) string {
	s := "kept for ever"
	if p.Keep > 0 {
		s = "kept " + formatKeep(p.Keep)
	}
	if p.MaxCount > 0 {
		s += fmt.Sprintf(", at most %d (the oldest seen go)", p.MaxCount)
	}
	return s
}

func formatKeep(d time.Duration) string {
	if d%(24*time.Hour) == 0 {
		return fmt.Sprintf("%dd", d/(24*time.Hour))
	}
	return d.String()
}

// parseKeep reads --keep: a Go duration, a number of days (7d), or
// forever; empty is for ever too (a dead-letter bound by count alone).
func parseKeep(s string) (time.Duration, error) {
	switch s = strings.TrimSpace(s); {
	case s == "" || s == "forever":
		return 0, nil
	case strings.HasSuffix(s, "d"):
		n, err := strconv.Atoi(strings.TrimSuffix(s, "d"))
		if err != nil || n <= 0 {
			return 0, fmt.Errorf("--keep %q: a number of days is written like 30d", s)
		}
		return time.Duration(n) * 24 * time.Hour, nil
	}
	d, err := time.ParseDuration(s)
	if err != nil || d <= 0 {
		return 0, fmt.Errorf("--keep %q: give a duration (36h, 7d) or forever", s)
	}
	return d, nil
}

// markSeen records that the person at this terminal was shown dead letter
// j (printed as text: --json output goes to programs, not people), which
// lets its kind's bounds drop it one day. A ledger that refuses the write
// (a read-only role) costs a warning, not the command.
func markSeen(cmd *cobra.Command, j idempotency.Job, mark func(by string) (int, error)) {
	if j.Status != idempotency.StatusDead {
		return
	}
	if _, err := mark(defaultActor()); err != nil {
		fmt.Fprintf(cmd.ErrOrStderr(), "warning: could not record that this dead letter was seen: %v\n", err)
	}
}
