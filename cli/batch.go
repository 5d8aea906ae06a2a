package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	"github.com/google/uuid"
	"github.com/spf13/cobra"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/jobstore"
)

func batchCmd(e *Env) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "batch",
		Short: "See batches: groups of jobs with a callback enqueued once every member has ended",
	}
	cmd.AddCommand(batchLsCmd(e), batchShowCmd(e))
	return cmd
}

// batchJSON is a batch as `batch ls` and `batch show` print it.
type batchJSON struct {
	ID          string     `json:"id"`
	Description string     `json:"description"`
	State       string     `json:"state"`
	Total       int        `json:"total"`
	Succeeded   int        `json:"succeeded"`
	Dead        int        `json:"dead"`
	Discarded   int        `json:"discarded"`
	Cancelled   int        `json:"cancelled"`
	Generation  int        `json:"generation"`
	CreatedAt   time.Time  `json:"created_at"`
	SealedAt    *time.Time `json:"sealed_at,omitempty"`
	CompletedAt *time.Time `json:"completed_at,omitempty"`
	// show only
	Open      map[string]int  `json:"open,omitempty"`
	Callbacks []callbackJSON  `json:"callbacks,omitempty"`
	OpenJobs  []batchMemberJS `json:"open_members,omitempty"`
	OpenShown int             `json:"open_members_shown,omitempty"`
	OpenTotal int             `json:"open_members_total,omitempty"`
}

type callbackJSON struct {
	Event  string `json:"event"`
	Kind   string `json:"kind"`
	Queue  string `json:"queue"`
	JobID  string `json:"job_id,omitempty"`
	Status string `json:"status,omitempty"`
}

type batchMemberJS struct {
	ID          string `json:"id"`
	Kind        string `json:"kind"`
	BusinessKey string `json:"business_key"`
	Status      string `json:"status"`
	Attempts    int    `json:"attempts"`
	LastError   string `json:"last_error,omitempty"`
}

func toBatchJSON(b jobstore.Batch) batchJSON {
	return batchJSON{ID: b.ID, Description: b.Description, State: b.State(), Total: b.Total, Succeeded: b.Succeeded,
		Dead: b.Dead, Discarded: b.Discarded, Cancelled: b.Cancelled, Generation: b.Generation,
		CreatedAt: b.CreatedAt, SealedAt: b.SealedAt, CompletedAt: b.CompletedAt}
}

func batchLsCmd(e *Env) *cobra.Command {
	var open bool
	var limit int
	cmd := &cobra.Command{
		Use:   "ls",
		Short: "List batches, newest first",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if limit < 1 || limit > 1000 {
				return usageError{fmt.Errorf("--limit %d: between 1 and 1000", limit)}
			}
			ctx := cmd.Context()
			pool, err := e.Ledger(ctx)
			if err != nil {
				return err
			}
			defer pool.Close()
			bs, err := jobstore.NewStore(pool).ListBatches(ctx, jobstore.BatchFilter{Open: open, Limit: limit})
			if err != nil {
				return err
			}
			out := cmd.OutOrStdout()
			if e.JSON() {
				list := make([]batchJSON, 0, len(bs))
				for _, b := range bs {
					list = append(list, toBatchJSON(b))
				}
				return printJSON(out, map[string]any{"batches": list})
			}
			tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
			fmt.Fprintln(tw, "CREATED\tBATCH\tSTATE\tENDED\tSUCCEEDED\tDEAD\tDISCARDED\tCANCELLED\tGEN\tDESCRIPTION")
			for _, b := range bs {
				fmt.Fprintf(tw, "%s\t%s\t%s\t%d/%d\t%d\t%d\t%d\t%d\t%d\t%s\n", b.CreatedAt.Format(time.RFC3339), b.ID, b.State(),
					b.Ended(), b.Total, b.Succeeded, b.Dead, b.Discarded, b.Cancelled, b.Generation, oneLine(b.Description, 60))
			}
			tw.Flush()
			fmt.Fprintf(out, "%d batch(es) shown\n", len(bs))
			return nil
		},
	}
	cmd.Flags().BoolVar(&open, "open", false, "only batches not complete")
	cmd.Flags().IntVar(&limit, "limit", 50, "show at most this many (up to 1000)")
	return cmd
}

func batchShowCmd(e *Env) *cobra.Command {
	var limit int
	cmd := &cobra.Command{
		Use:   "show BATCH_ID",
		Short: "Show a batch: progress, the members still open, its callbacks",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if _, err := uuid.Parse(args[0]); err != nil {
				return usageError{fmt.Errorf("batch id %q is malformed: a batch id is a UUID like 01936f3e-8c1a-7b2e-9f00-1a2b3c4d5e6f", args[0])}
			}
			ctx := cmd.Context()
			pool, err := e.Ledger(ctx)
			if err != nil {
				return err
			}
			defer pool.Close()
			v, err := loadBatch(ctx, jobstore.NewStore(pool), args[0], limit)
			if errors.Is(err, jobstore.ErrBatchNotFound) {
				return fmt.Errorf("no batch with id %s", args[0])
			}
			if err != nil {
				return err
			}
			if e.JSON() {
				return printJSON(cmd.OutOrStdout(), v)
			}
			printBatch(cmd.OutOrStdout(), v)
			return nil
		},
	}
	cmd.Flags().IntVar(&limit, "limit", 20, "show at most this many open members")
	return cmd
}

func loadBatch(ctx context.Context, store *jobstore.Store, id string, limit int) (batchJSON, error) {
	b, err := store.GetBatch(ctx, id)
	if err != nil {
		return batchJSON{}, err
	}
	v := toBatchJSON(b)
	statuses, err := store.BatchStatuses(ctx, id)
	if err != nil {
		return batchJSON{}, err
	}
	v.Open = map[string]int{}
	for _, st := range []idempotency.Status{idempotency.StatusWaiting, idempotency.StatusPending, idempotency.StatusPaused,
		idempotency.StatusRunning, idempotency.StatusFailed} {
		v.Open[string(st)] = statuses[st]
		v.OpenTotal += statuses[st]
	}
	members, err := store.OpenMembers(ctx, id, limit)
	if err != nil {
		return batchJSON{}, err
	}
	for _, j := range members {
		v.OpenJobs = append(v.OpenJobs, batchMemberJS{ID: j.ID, Kind: j.Kind, BusinessKey: j.BusinessKey,
			Status: string(j.Status), Attempts: j.Attempts, LastError: j.LastError})
	}
	v.OpenShown = len(members)
	for _, cb := range []struct {
		event string
		spec  *jobstore.BatchCallback
		jobID string
	}{{"complete", b.OnComplete, b.CompleteJobID}, {"success", b.OnSuccess, b.SuccessJobID}} {
		if cb.spec == nil {
			continue
		}
		c := callbackJSON{Event: cb.event, Kind: cb.spec.Kind, Queue: cb.spec.Queue, JobID: cb.jobID}
		if cb.jobID != "" {
			j, err := store.Get(ctx, cb.jobID)
			switch {
			case err == nil:
				c.Status = string(j.Status)
			case errors.Is(err, idempotency.ErrNotFound):
				c.Status = "pruned"
			default:
				return batchJSON{}, err
			}
		}
		v.Callbacks = append(v.Callbacks, c)
	}
	return v, nil
}

func printBatch(w io.Writer, v batchJSON) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintf(tw, "batch\t%s\n", v.ID)
	fmt.Fprintf(tw, "description\t%s\n", oneRow(v.Description))
	fmt.Fprintf(tw, "state\t%s\n", v.State)
	fmt.Fprintf(tw, "ended\t%d of %d: %d succeeded, %d dead, %d discarded, %d cancelled\n",
		v.Succeeded+v.Dead+v.Discarded+v.Cancelled, v.Total, v.Succeeded, v.Dead, v.Discarded, v.Cancelled)
	fmt.Fprintf(tw, "open\t%d: %d pending, %d running, %d failed (will retry), %d waiting, %d paused\n", v.OpenTotal,
		v.Open["pending"], v.Open["running"], v.Open["failed"], v.Open["waiting"], v.Open["paused"])
	fmt.Fprintf(tw, "completions\t%d\n", v.Generation)
	fmt.Fprintf(tw, "created\t%s\n", v.CreatedAt.Format(time.RFC3339))
	if v.SealedAt != nil {
		fmt.Fprintf(tw, "sealed\t%s\n", v.SealedAt.Format(time.RFC3339))
	}
	if v.CompletedAt != nil {
		fmt.Fprintf(tw, "completed\t%s\n", v.CompletedAt.Format(time.RFC3339))
	}
	for _, c := range v.Callbacks {
		state := "not enqueued yet"
		if c.JobID != "" {
			state = "job " + c.JobID + " " + c.Status
		}
		fmt.Fprintf(tw, "on %s\t%s (queue %s): %s\n", c.Event, oneRow(c.Kind), oneRow(c.Queue), state)
	}
	tw.Flush()
	if len(v.OpenJobs) == 0 {
		return
	}
	fmt.Fprintf(w, "\nopen members (%d of %d)\n", v.OpenShown, v.OpenTotal)
	tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "JOB\tKIND\tBUSINESS KEY\tSTATUS\tATTEMPTS\tLAST ERROR")
	for _, j := range v.OpenJobs {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%d\t%s\n", j.ID, oneLine(j.Kind, 60), oneLine(j.BusinessKey, 40), j.Status, j.Attempts, oneLine(j.LastError, 60))
	}
	tw.Flush()
}
