package cli

import (
	"errors"
	"fmt"
	"strings"

	"github.com/spf13/cobra"

	"github.com/keeljobs/keel/inspect"
	"github.com/keeljobs/keel/internal/visible"
)

// cancelResult is what `cancel` prints per job.
type cancelResult struct {
	ID               string `json:"id"`
	Status           string `json:"status,omitempty"`
	AlreadyCancelled bool   `json:"already_cancelled,omitempty"`
	WasRunning       bool   `json:"was_running,omitempty"`
	Warning          string `json:"warning,omitempty"`
	Error            string `json:"error,omitempty"`
}

// cancelCmd cancels jobs that have not finished, by id or by kind and
// business key.
func cancelCmd(e *Env) *cobra.Command {
	var kind, key, actor, note string
	cmd := &cobra.Command{
		Use:   "cancel [JOB_ID...]",
		Short: "Cancel jobs that have not finished: a waiting job never runs, a running job's handler is stopped",
		Long: "Cancel jobs that have not finished: a pending, scheduled or failed job never runs; a running\n" +
			"job's handler context is cancelled and nothing it does from then on commits. Effects that\n" +
			"already happened are not undone. Name jobs by id, or one job by --kind and --key.\n" +
			"A cancelled job is terminal: enqueueing its business key again returns it.",
		RunE: func(cmd *cobra.Command, args []string) error {
			byKey := kind != "" || key != ""
			switch {
			case byKey && len(args) > 0:
				return usageError{errors.New("name job ids, or one job by --kind and --key, not both")}
			case byKey && (kind == "" || key == ""):
				return usageError{errors.New("--kind and --key go together")}
			case !byKey && len(args) == 0:
				return usageError{errors.New("name job ids, or one job by --kind and --key")}
			}
			args, err := actorNoteIDs(actor, note, args)
			if err != nil {
				return err
			}
			ctx := cmd.Context()
			ops, _, done, err := e.operator(ctx, true)
			if err != nil {
				return err
			}
			defer done()
			if byKey {
				j, err := ops.Lookup(ctx, kind, key)
				if errors.Is(err, inspect.ErrNotFound) {
					return fmt.Errorf("no job with kind %q and business key %q: %w", kind, key, err)
				}
				if err != nil {
					return err
				}
				args = []string{j.ID}
			}
			out, stderr := cmd.OutOrStdout(), cmd.ErrOrStderr()
			results := make([]cancelResult, 0, len(args))
			failed, unchanged := 0, 0
			for _, id := range args {
				res, err := ops.Cancel(ctx, id, actor, note)
				r := cancelResult{ID: id}
				switch {
				case errors.Is(err, inspect.ErrNotFound):
					r.Error = fmt.Sprintf("no job with id %q", id)
				case err != nil:
					r.Error = strings.TrimPrefix(err.Error(), "keel: ")
				default:
					r.Status, r.AlreadyCancelled, r.WasRunning = string(res.Job.Status), res.AlreadyCancelled, res.WasRunning
					if res.RedisErr != nil {
						r.Warning = "the ledger says cancelled, but Redis was not cleaned up (" + res.RedisErr.Error() +
							"); a worker acknowledges any delivery without running it"
					}
				}
				switch {
				case r.Error != "":
					failed++
				case r.AlreadyCancelled:
					unchanged++
				}
				results = append(results, r)
				if e.JSON() {
					continue
				}
				switch {
				case r.Error != "" && len(args) == 1:
					// Returned as the command's error: one line.
				case r.Error != "":
					fmt.Fprintln(stderr, visible.Text(fmt.Sprintf("cancel %s: %s", id, r.Error)))
				case r.AlreadyCancelled:
					fmt.Fprintf(out, "%s: already cancelled\n", id)
				case r.WasRunning:
					fmt.Fprintf(out, "%s: cancelled; it was running, its handler is being stopped\n", id)
				default:
					fmt.Fprintf(out, "%s: cancelled\n", id)
				}
				if r.Warning != "" {
					fmt.Fprintln(stderr, visible.Text(fmt.Sprintf("cancel %s: warning: %s", id, r.Warning)))
				}
			}
			if e.JSON() {
				if err := printJSON(out, map[string]any{"action": "cancel", "done": len(args) - failed - unchanged, "unchanged": unchanged,
					"failed": failed, "jobs": results}); err != nil {
					return err
				}
			}
			return actionError(failed, len(args), results[0].Error, "cancelled")
		},
	}
	f := cmd.Flags()
	f.StringVar(&kind, "kind", "", "the job's kind (with --key)")
	f.StringVar(&key, "key", "", "the job's business key (with --kind)")
	f.StringVar(&actor, "actor", defaultActor(), "who is acting (kept in the audit log)")
	f.StringVar(&note, "note", "", "why (kept with the job and in the audit log)")
	return cmd
}
