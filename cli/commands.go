package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"runtime/debug"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/keeljobs/keel/flow"
	"github.com/keeljobs/keel/handlers"
	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/outbox"
	"github.com/keeljobs/keel/server"
	"github.com/keeljobs/keel/tasks"
)

// version is set at build time with -ldflags "-X main.version=…".
var version = ""

func versionString() string {
	if version != "" {
		return version
	}
	if bi, ok := debug.ReadBuildInfo(); ok && bi.Main.Version != "" && bi.Main.Version != "(devel)" {
		return bi.Main.Version
	}
	return "dev"
}

func newRoot() *cobra.Command {
	c := &conn{}
	root := &cobra.Command{
		Use:           "keel",
		Short:         "Reliable background jobs: Asynq schedules, Postgres remembers",
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	c.bind(root)
	root.AddCommand(versionCmd(), migrateCmd(c), workerCmd(c), relayCmd(c), enqueueCmd(c), statusCmd(c), ledgerCmd(c), demoCmd(c), deadCmd(c), webCmd(c), schedulerCmd(c), benchCmd(c), apiCmd(c))
	return root
}

func versionCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "version",
		Short: "Print keel's version and ledger schema version",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			fmt.Fprintf(cmd.OutOrStdout(), "keel %s (ledger schema %d)\n", versionString(), idempotency.SchemaVersion())
			return nil
		},
	}
}

func migrateCmd(c *conn) *cobra.Command {
	return &cobra.Command{
		Use:   "migrate",
		Short: "Create or upgrade the ledger schema (safe to run any number of times)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx := cmd.Context()
			if err := c.createDatabase(ctx); err != nil {
				return err
			}
			pool, err := c.pool(ctx)
			if err != nil {
				return err
			}
			defer pool.Close()
			res, err := idempotency.Migrate(ctx, pool)
			if err != nil {
				return err
			}
			if err := handlers.Migrate(ctx, pool); err != nil {
				return fmt.Errorf("example tables: %w", err)
			}
			if len(res.Applied) == 0 {
				fmt.Fprintf(cmd.OutOrStdout(), "ledger schema is current (version %d)\n", res.To)
				return nil
			}
			fmt.Fprintf(cmd.OutOrStdout(), "ledger schema %d → %d (applied %v)\n", res.From, res.To, res.Applied)
			return nil
		},
	}
}

func workerCmd(c *conn) *cobra.Command {
	w := &workerFlags{}
	lf := &limitFlags{}
	of := &observeFlags{}
	cmd := &cobra.Command{
		Use:   "worker",
		Short: "Run a worker with the example order handlers (build your own binary with server.New for your handlers)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg, err := w.config()
			if err != nil {
				return err
			}
			// Every flag is checked before anything is connected to.
			rules, err := lf.rules()
			if err != nil {
				return err
			}
			ctx := cmd.Context()
			svc, err := c.openService(ctx)
			if err != nil {
				return err
			}
			defer svc.pool.Close()
			redis, pool, log := svc.redis, svc.pool, svc.log
			cfg.Redis, cfg.Pool, cfg.Logger = redis, pool, log
			if len(rules) > 0 {
				limits, err := flow.New(redis, flow.Config{Rules: rules, Logger: log})
				if err != nil {
					return usageError{err}
				}
				defer limits.Close()
				cfg.Middleware = append(cfg.Middleware, limits.Middleware)
			}
			ob, err := of.wire(&cfg, nil, log)
			if err != nil {
				return err
			}
			mux := tasks.NewMux()
			handlers.Register(mux, handlers.Deps{Pool: pool, Mailer: handlers.LogMailer{Log: log}})
			srv, err := server.New(cfg, mux)
			if err != nil {
				return usageError{err}
			}
			ob.attach(srv)
			var wg sync.WaitGroup
			octx, stop := context.WithCancel(ctx)
			defer func() { stop(); wg.Wait() }()
			if err := ob.run(octx, &wg); err != nil {
				srv.Close()
				return err
			}
			return srv.Run(ctx)
		},
	}
	w.bind(cmd)
	lf.bind(cmd)
	of.bind(cmd)
	return cmd
}

func relayCmd(c *conn) *cobra.Command {
	var cfg outbox.RelayConfig
	var rcfg outbox.ReconcilerConfig
	var rf reconcileFlags
	var noReconcile bool
	cmd := &cobra.Command{
		Use:   "relay",
		Short: "Publish committed ledger jobs to Redis (workers run one too; run this for a dedicated relay)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if cfg.PollInterval < 0 || cfg.BatchSize < 0 {
				return usageError{fmt.Errorf("--poll-interval and --batch-size must not be negative")}
			}
			if err := rf.apply(&rcfg); err != nil {
				return err
			}
			ctx := cmd.Context()
			svc, err := c.openService(ctx)
			if err != nil {
				return err
			}
			defer svc.pool.Close()
			redis, pool, log := svc.redis, svc.pool, svc.log
			cfg.Logger = log
			r := outbox.NewRelay(pool, redis, cfg)
			defer r.Close()
			var wg sync.WaitGroup
			if !noReconcile {
				rcfg.Logger = log
				rec := outbox.NewReconciler(pool, redis, rcfg)
				defer rec.Close()
				wg.Go(func() { _ = rec.Run(ctx) })
			}
			log.Info("keel relay started", "reconciler", !noReconcile)
			err = r.Run(ctx)
			wg.Wait()
			log.Info("keel relay stopped", "published", r.Published())
			return err
		},
	}
	cmd.Flags().DurationVar(&cfg.PollInterval, "poll-interval", outbox.DefaultPollInterval, "fallback poll interval")
	cmd.Flags().IntVar(&cfg.BatchSize, "batch-size", outbox.DefaultBatchSize, "rows per publish pass")
	cmd.Flags().BoolVar(&noReconcile, "no-reconciler", false, "publish only; do not reconcile with Redis or prune")
	rf.bind(cmd)
	// --grace is the name this flag had before the worker got it too.
	cmd.Flags().DurationVar(&rf.grace, "grace", rf.grace, "")
	_ = cmd.Flags().MarkDeprecated("grace", "use --reconcile-grace")
	cmd.Flags().DurationVar(&rcfg.Retention, "retention", envDuration("KEEL_RETENTION", outbox.DefaultRetention),
		"keep succeeded/discarded jobs this long; also the business-key dedupe window (env KEEL_RETENTION)")
	return cmd
}

func enqueueCmd(c *conn) *cobra.Command {
	var payload, queue string
	var delay time.Duration
	var maxRetry int
	cmd := &cobra.Command{
		Use:   "enqueue KIND BUSINESS_KEY",
		Short: "Enqueue a job through the ledger (the same kind and key twice is one job)",
		Args:  cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			if !json.Valid([]byte(payload)) {
				return usageError{fmt.Errorf("--payload is not valid JSON: %q", payload)}
			}
			redis, err := c.redis()
			if err != nil {
				return err
			}
			ctx := cmd.Context()
			pool, err := c.pool(ctx)
			if err != nil {
				return err
			}
			defer pool.Close()
			client, err := tasks.NewClient(tasks.ClientConfig{Redis: redis, Pool: pool})
			if err != nil {
				return err
			}
			defer client.Close()
			var opts []tasks.Option
			if queue != "" {
				opts = append(opts, tasks.Queue(queue))
			}
			if delay > 0 {
				opts = append(opts, tasks.Delay(delay))
			}
			if cmd.Flags().Changed("max-retry") {
				opts = append(opts, tasks.MaxRetry(maxRetry))
			}
			res, err := client.Enqueue(ctx, tasks.NewRaw(args[0], []byte(payload), args[1], opts...))
			if err != nil {
				return err
			}
			state := "created"
			if res.Existed {
				state = "already existed"
			}
			fmt.Fprintf(cmd.OutOrStdout(), "job %s %s (status %s, queue %s)\n", res.Job.ID, state, res.Job.Status, res.Job.Queue)
			return nil
		},
	}
	cmd.Flags().StringVar(&payload, "payload", "{}", "JSON payload")
	cmd.Flags().StringVar(&queue, "queue", "", "queue (default: the kind's queue, or default)")
	cmd.Flags().DurationVar(&delay, "delay", 0, "run no earlier than this from now")
	cmd.Flags().IntVar(&maxRetry, "max-retry", tasks.DefaultMaxRetry, "retry budget")
	return cmd
}

func statusCmd(c *conn) *cobra.Command {
	var asJSON bool
	var id string
	cmd := &cobra.Command{
		Use:   "status [KIND BUSINESS_KEY]",
		Short: "Show what state a business action's job is in, and who holds it",
		Example: "  keel status order:send_receipt order:123\n" +
			"  keel status --id 01936f3e-...",
		RunE: func(cmd *cobra.Command, args []string) error {
			if (id == "") == (len(args) != 2) {
				return usageError{fmt.Errorf("give KIND and BUSINESS_KEY, or --id")}
			}
			ctx := cmd.Context()
			pool, err := c.pool(ctx)
			if err != nil {
				return err
			}
			defer pool.Close()
			store := idempotency.NewStore(pool)
			var job idempotency.Job
			if id != "" {
				job, err = store.Get(ctx, id)
			} else {
				job, err = store.Lookup(ctx, args[0], args[1])
			}
			if err != nil {
				return err
			}
			steps, err := store.Steps(ctx, job.ID)
			if err != nil {
				return err
			}
			if asJSON {
				return printStatusJSON(cmd.OutOrStdout(), job, steps)
			}
			printStatus(cmd.OutOrStdout(), job, steps)
			return nil
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	cmd.Flags().StringVar(&id, "id", "", "look up by job id instead")
	return cmd
}

type stepJSON struct {
	Name       string     `json:"name"`
	Status     string     `json:"status"`
	Calls      int        `json:"calls"`
	Result     string     `json:"result,omitempty"`
	StartedAt  time.Time  `json:"started_at"`
	FinishedAt *time.Time `json:"finished_at,omitempty"`
}

type statusJSON struct {
	ID             string     `json:"id"`
	Kind           string     `json:"kind"`
	BusinessKey    string     `json:"business_key"`
	Queue          string     `json:"queue"`
	Status         string     `json:"status"`
	Attempts       int        `json:"attempts"`
	MaxRetry       int        `json:"max_retry"`
	LastError      string     `json:"last_error,omitempty"`
	ErrorClass     string     `json:"error_class,omitempty"`
	LeaseHolder    string     `json:"lease_holder,omitempty"`
	LeaseUntil     *time.Time `json:"lease_until,omitempty"`
	RunAt          time.Time  `json:"run_at"`
	PublishedAt    *time.Time `json:"published_at,omitempty"`
	CreatedAt      time.Time  `json:"created_at"`
	UpdatedAt      time.Time  `json:"updated_at"`
	FinishedAt     *time.Time `json:"finished_at,omitempty"`
	PayloadSummary string     `json:"payload_summary,omitempty"`
	TraceID        string     `json:"trace_id,omitempty"`
	ResolutionNote string     `json:"resolution_note,omitempty"`
	Steps          []stepJSON `json:"steps"`
}

func printStatusJSON(w io.Writer, j idempotency.Job, steps []idempotency.StepRecord) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(toStatusJSON(j, steps))
}

func toStatusJSON(j idempotency.Job, steps []idempotency.StepRecord) statusJSON {
	out := statusJSON{ID: j.ID, Kind: j.Kind, BusinessKey: j.BusinessKey, Queue: j.Queue, Status: string(j.Status),
		Attempts: j.Attempts, MaxRetry: j.MaxRetry, LastError: j.LastError, ErrorClass: j.ErrorClass,
		LeaseHolder: j.LeaseHolder, LeaseUntil: j.LeaseUntil, RunAt: j.RunAt, PublishedAt: j.PublishedAt,
		CreatedAt: j.CreatedAt, UpdatedAt: j.UpdatedAt, FinishedAt: j.FinishedAt, PayloadSummary: j.PayloadSummary,
		TraceID: j.TraceID, ResolutionNote: j.ResolutionNote, Steps: []stepJSON{}}
	for _, s := range steps {
		out.Steps = append(out.Steps, stepJSON{Name: s.Name, Status: s.Status, Calls: s.Calls, Result: string(s.Result),
			StartedAt: s.StartedAt, FinishedAt: s.FinishedAt})
	}
	return out
}

func printStatus(w io.Writer, j idempotency.Job, steps []idempotency.StepRecord) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	row := func(k, v string) {
		if v != "" {
			fmt.Fprintf(tw, "%s\t%s\n", k, v)
		}
	}
	ts := func(t *time.Time) string {
		if t == nil {
			return ""
		}
		return t.Format(time.RFC3339)
	}
	row("job", j.ID)
	row("kind", j.Kind)
	row("business key", j.BusinessKey)
	row("queue", j.Queue)
	row("status", string(j.Status))
	row("attempts", fmt.Sprintf("%d (max retry %d)", j.Attempts, j.MaxRetry))
	row("last error", j.LastError)
	row("error class", j.ErrorClass)
	if j.LeaseHolder != "" {
		row("lease", fmt.Sprintf("%s until %s", j.LeaseHolder, ts(j.LeaseUntil)))
	}
	row("run at", j.RunAt.Format(time.RFC3339))
	row("published", ts(j.PublishedAt))
	row("created", j.CreatedAt.Format(time.RFC3339))
	row("updated", j.UpdatedAt.Format(time.RFC3339))
	row("finished", ts(j.FinishedAt))
	row("payload summary", j.PayloadSummary)
	row("trace id", j.TraceID)
	row("resolution", j.ResolutionNote)
	for _, s := range steps {
		row("step "+s.Name, fmt.Sprintf("%s (calls %d, started %s, finished %s)", s.Status, s.Calls, s.StartedAt.Format(time.RFC3339), ts(s.FinishedAt)))
	}
	tw.Flush()
}
