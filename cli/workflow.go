package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/spf13/cobra"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/inspect"
	"github.com/keeljobs/keel/internal/ledger"
	"github.com/keeljobs/keel/internal/visible"
)

// relatedJSON is a job at the other end of a dependency.
type relatedJSON struct {
	ID          string `json:"id"`
	Kind        string `json:"kind"`
	BusinessKey string `json:"business_key"`
	Status      string `json:"status"`
	ErrorClass  string `json:"error_class,omitempty"`
	// Met: the dependency is met (a parent: it succeeded, or died after
	// its completing InTx had committed).
	Met bool `json:"met"`
}

// depsJSON is what `status --json` says of a job's dependencies.
type depsJSON struct {
	WaitingOn    int           `json:"waiting_on"`
	Workflow     string        `json:"workflow,omitempty"`
	WorkflowTask string        `json:"workflow_task,omitempty"`
	Parents      []relatedJSON `json:"parents"`
	Children     []relatedJSON `json:"children"`
}

func toRelatedJSON(rs []inspect.Related) []relatedJSON {
	out := make([]relatedJSON, 0, len(rs))
	for _, r := range rs {
		out = append(out, relatedJSON{ID: r.ID, Kind: r.Kind, BusinessKey: r.BusinessKey, Status: string(r.Status), ErrorClass: r.ErrorClass, Met: r.Met})
	}
	return out
}

// loadDeps reads job j's dependencies, nil when it has none.
func loadDeps(ctx context.Context, pool *pgxpool.Pool, j idempotency.Job) (*depsJSON, error) {
	parents, err := ledger.ParentsOf(ctx, pool, j.ID)
	if err != nil {
		return nil, err
	}
	children, err := ledger.ChildrenOf(ctx, pool, j.ID)
	if err != nil {
		return nil, err
	}
	if len(parents) == 0 && len(children) == 0 && j.WorkflowID == "" {
		return nil, nil
	}
	return &depsJSON{WaitingOn: j.WaitingOn, Workflow: j.WorkflowID, WorkflowTask: j.WorkflowTask,
		Parents: toRelatedJSON(parents), Children: toRelatedJSON(children)}, nil
}

// printDeps writes a job's dependencies under its status: what it waits
// for (and why it may wait long: a dead parent), and what waits for it.
func printDeps(w io.Writer, prog string, j idempotency.Job, d *depsJSON) {
	if d == nil {
		return
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	if d.Workflow != "" {
		fmt.Fprintf(tw, "workflow\t%s (task %s): %s workflow show %s\n", oneRow(d.Workflow), oneRow(d.WorkflowTask), prog, oneRow(d.Workflow))
	}
	label := "after"
	for _, p := range d.Parents {
		note := string(p.Status)
		switch {
		case p.Met && p.Status != string(idempotency.StatusSucceeded):
			note += ": met, its completing InTx committed"
		case j.Status == idempotency.StatusWaiting && p.Status == string(idempotency.StatusDead):
			note += fmt.Sprintf(": this job waits until it is replayed and succeeds (%s dead replay %s), or released (%s release %s)", prog, p.ID, prog, j.ID)
		case j.Status == idempotency.StatusWaiting && p.Status != string(idempotency.StatusSucceeded):
			note += ": waited for"
		}
		fmt.Fprintf(tw, "%s\t%s %s/%s (%s)\n", label, p.ID, oneRow(p.Kind), oneRow(p.BusinessKey), note)
		label = ""
	}
	label = "before"
	for _, c := range d.Children {
		fmt.Fprintf(tw, "%s\t%s %s/%s (%s)\n", label, c.ID, oneRow(c.Kind), oneRow(c.BusinessKey), c.Status)
		label = ""
	}
	tw.Flush()
}

// workflowCmd shows a workflow's jobs (tasks.Workflow).
func workflowCmd(e *Env) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "workflow",
		Short: "Show a workflow's tasks: each one's job, status and what it runs after",
	}
	cmd.AddCommand(&cobra.Command{
		Use:     "show WORKFLOW_ID",
		Short:   "Show every task of a workflow with its job's status and what it waits for",
		Example: "  keel workflow show order-123-fulfilment",
		Args:    cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx := cmd.Context()
			pool, err := e.Ledger(ctx)
			if err != nil {
				return err
			}
			defer pool.Close()
			nodes, err := ledger.Workflow(ctx, pool, args[0])
			if err != nil {
				return err
			}
			if len(nodes) == 0 {
				return fmt.Errorf("no workflow with id %q: %w", args[0], inspect.ErrNotFound)
			}
			return printWorkflow(cmd.OutOrStdout(), e.JSON(), args[0], nodes)
		},
	})
	return cmd
}

type workflowTaskJSON struct {
	Task        string   `json:"task"`
	ID          string   `json:"id"`
	Kind        string   `json:"kind"`
	BusinessKey string   `json:"business_key"`
	Status      string   `json:"status"`
	WaitingOn   int      `json:"waiting_on"`
	After       []string `json:"after"`
}

// printWorkflow writes a workflow's tasks, parents first, each with the
// tasks it runs after (by name where the parent is in the workflow).
func printWorkflow(w io.Writer, asJSON bool, id string, nodes []inspect.WorkflowNode) error {
	name := make(map[string]string, len(nodes))
	for _, n := range nodes {
		name[n.ID] = n.Task
	}
	tasks := make([]workflowTaskJSON, 0, len(nodes))
	counts := map[string]int{}
	for _, n := range nodes {
		t := workflowTaskJSON{Task: n.Task, ID: n.ID, Kind: n.Kind, BusinessKey: n.BusinessKey, Status: string(n.Status),
			WaitingOn: n.WaitingOn, After: []string{}}
		for _, p := range n.Parents {
			if nm, ok := name[p]; ok {
				t.After = append(t.After, nm)
			} else {
				t.After = append(t.After, p)
			}
		}
		tasks = append(tasks, t)
		counts[t.Status]++
	}
	if asJSON {
		return printJSON(w, map[string]any{"workflow": id, "counts": counts, "tasks": tasks})
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintf(tw, "TASK\tSTATUS\tAFTER\tJOB\tKIND/KEY\n")
	for _, t := range tasks {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s/%s\n", oneRow(t.Task), t.Status, oneRow(strings.Join(t.After, ",")), t.ID,
			oneRow(t.Kind), oneRow(t.BusinessKey))
	}
	return tw.Flush()
}

// releaseCmd starts waiting jobs without waiting for their parents.
func releaseCmd(e *Env) *cobra.Command {
	var actor, note string
	cmd := &cobra.Command{
		Use:   "release JOB_ID...",
		Short: "Start waiting jobs now, without waiting for their parents to succeed",
		Long: "Start jobs that wait for others (tasks.After, a workflow's tasks) now: for when a parent\n" +
			"died and will not be replayed, or its outcome no longer matters. Audited. A job that no\n" +
			"longer waits is left as it is.",
		Args: cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			args, err := actorNoteIDs(actor, note, args)
			if err != nil {
				return err
			}
			ctx := cmd.Context()
			ops, _, done, err := e.operator(ctx, false)
			if err != nil {
				return err
			}
			defer done()
			type result struct {
				ID              string `json:"id"`
				Status          string `json:"status,omitempty"`
				AlreadyReleased bool   `json:"already_released,omitempty"`
				Error           string `json:"error,omitempty"`
			}
			out, stderr := cmd.OutOrStdout(), cmd.ErrOrStderr()
			results := make([]result, 0, len(args))
			failed := 0
			for _, id := range args {
				res, err := ops.Release(ctx, id, actor, note)
				r := result{ID: id}
				switch {
				case errors.Is(err, inspect.ErrNotFound):
					r.Error = fmt.Sprintf("no job with id %q", id)
				case err != nil:
					r.Error = strings.TrimPrefix(err.Error(), "keel: ")
				default:
					r.Status, r.AlreadyReleased = string(res.Job.Status), res.AlreadyReleased
				}
				results = append(results, r)
				if r.Error != "" {
					failed++
				}
				if e.JSON() {
					continue
				}
				switch {
				case r.Error != "" && len(args) == 1:
				case r.Error != "":
					fmt.Fprintln(stderr, visible.Text(fmt.Sprintf("release %s: %s", id, r.Error)))
				case r.AlreadyReleased:
					fmt.Fprintf(out, "%s: not waiting (%s); left as it is\n", id, r.Status)
				default:
					fmt.Fprintf(out, "%s: released\n", id)
				}
			}
			if e.JSON() {
				if err := printJSON(out, map[string]any{"action": "release", "failed": failed, "jobs": results}); err != nil {
					return err
				}
			}
			return actionError(failed, len(args), results[0].Error, "released")
		},
	}
	f := cmd.Flags()
	f.StringVar(&actor, "actor", defaultActor(), "who is acting (kept in the audit log)")
	f.StringVar(&note, "note", "", "why (kept in the audit log)")
	return cmd
}
