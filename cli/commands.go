package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"runtime"
	"runtime/debug"
	"slices"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/spf13/cobra"

	"github.com/keeljobs/keel/flow"
	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/jobstore"
	"github.com/keeljobs/keel/internal/ledger"
	"github.com/keeljobs/keel/internal/visible"
	"github.com/keeljobs/keel/migrate"
	"github.com/keeljobs/keel/outbox"
	"github.com/keeljobs/keel/server"
	"github.com/keeljobs/keel/tasks"
)

// printJSON writes v as indented JSON.
func printJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// VersionInfo is what `version` prints: the program's module version and
// VCS revision as the Go toolchain embedded them, and keel's.
type VersionInfo struct {
	Program      string `json:"program"`
	Module       string `json:"module,omitempty"`
	Version      string `json:"version"`
	Revision     string `json:"revision,omitempty"`
	RevisionTime string `json:"revision_time,omitempty"`
	Modified     bool   `json:"modified,omitempty"`
	Keel         string `json:"keel"`
	LedgerSchema int    `json:"ledger_schema"`
	Go           string `json:"go"`
}

const keelModule = "github.com/keeljobs/keel"

func buildVersion(program string) VersionInfo {
	v := VersionInfo{Program: program, Version: "(devel)", Keel: "(devel)", LedgerSchema: migrate.Version(), Go: runtime.Version()}
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return v
	}
	v.Module = bi.Main.Path
	if bi.Main.Version != "" {
		v.Version = bi.Main.Version
	}
	if bi.Main.Path == keelModule {
		v.Keel = v.Version
	}
	for _, d := range bi.Deps {
		if d.Path == keelModule {
			v.Keel = d.Version
			if d.Replace != nil {
				v.Keel = d.Replace.Version
				if v.Keel == "" {
					v.Keel = "(devel)"
				}
			}
		}
	}
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			v.Revision = s.Value
		case "vcs.time":
			v.RevisionTime = s.Value
		case "vcs.modified":
			v.Modified = s.Value == "true"
		}
	}
	return v
}

func (v VersionInfo) String() string {
	s := v.Program + " " + v.Version
	if v.Revision != "" {
		rev := v.Revision
		if len(rev) > 12 {
			rev = rev[:12]
		}
		s += " (revision " + rev
		if v.Modified {
			s += ", modified"
		}
		s += ")"
	}
	if v.Module != keelModule {
		s += ", keel " + v.Keel
	}
	return fmt.Sprintf("%s, ledger schema %d, %s", s, v.LedgerSchema, v.Go)
}

func versionCmd(e *Env) *cobra.Command {
	return &cobra.Command{
		Use:   "version",
		Short: "Print the program's version and VCS revision, keel's version and the ledger schema version",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			v := buildVersion(e.app.name())
			if e.JSON() {
				return printJSON(cmd.OutOrStdout(), v)
			}
			fmt.Fprintln(cmd.OutOrStdout(), v.String())
			return nil
		},
	}
}

func migrateCmd(e *Env) *cobra.Command {
	var print, check bool
	cmd := &cobra.Command{
		Use:   "migrate",
		Short: "Create the database if needed and create or upgrade the ledger schema (safe to run any number of times)",
		Long: `Create the database if needed and create or upgrade the ledger schema.
It is safe to run any number of times, and by any number of processes at once.

--print shows the SQL it would run, in order, and changes nothing: every
migration for a database keel has never migrated. A DBA can read it, or run
it by hand. --check changes nothing either: it exits 0 when the schema is
current and 1, naming the migrations missing, when it is not.`,
		Example: `  keel migrate --print > upgrade.sql
  keel migrate --check && echo current`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx := cmd.Context()
			if print || check {
				if print && check {
					return usageError{fmt.Errorf("--print and --check do not go together")}
				}
				return migratePending(cmd, e, check)
			}
			if err := e.CreateDatabase(ctx); err != nil {
				return err
			}
			pool, err := e.Pool(ctx)
			if err != nil {
				return err
			}
			defer pool.Close()
			res, err := migrate.Up(ctx, pool)
			if err != nil {
				return err
			}
			if e.app.Migrate != nil {
				if err := e.app.Migrate(ctx, pool); err != nil {
					return fmt.Errorf("%s's own tables: %w", e.app.name(), err)
				}
			}
			if e.JSON() {
				applied := res.Applied
				if applied == nil {
					applied = []string{}
				}
				return printJSON(cmd.OutOrStdout(), map[string]any{"from": res.From, "to": res.To, "applied": applied})
			}
			if len(res.Applied) == 0 {
				fmt.Fprintf(cmd.OutOrStdout(), "ledger schema is current (version %d)\n", res.To)
				return nil
			}
			fmt.Fprintf(cmd.OutOrStdout(), "ledger schema %d → %d (applied %v)\n", res.From, res.To, res.Applied)
			return nil
		},
	}
	cmd.Flags().BoolVar(&print, "print", false, "print the SQL of the migrations the database lacks, and change nothing")
	cmd.Flags().BoolVar(&check, "check", false, "exit 1 if the schema lacks a migration, and change nothing")
	return cmd
}

// errSchemaBehind is what migrate --check fails with.
var errSchemaBehind = errors.New("the ledger schema lacks migrations")

// migratePending prints (or, with check, counts) the migrations the ledger
// lacks. A database that does not exist yet lacks all of them.
func migratePending(cmd *cobra.Command, e *Env, check bool) error {
	ctx := cmd.Context()
	var pending []migrate.Migration
	exists, err := e.DatabaseExists(ctx)
	if err != nil {
		return err
	}
	if exists {
		pool, err := e.Pool(ctx)
		if err != nil {
			return err
		}
		defer pool.Close()
		if pending, err = migrate.Pending(ctx, pool); err != nil {
			return err
		}
	} else if pending, err = migrate.All(); err != nil {
		return err
	}
	names := make([]string, len(pending))
	for i, m := range pending {
		names[i] = m.Name
	}
	out := cmd.OutOrStdout()
	if check {
		if e.JSON() {
			if err := printJSON(out, map[string]any{"current": len(pending) == 0, "missing": names}); err != nil {
				return err
			}
		}
		if len(pending) > 0 {
			return fmt.Errorf("%w: %s: run `%s migrate`", errSchemaBehind, strings.Join(names, ", "), e.app.name())
		}
		if !e.JSON() {
			fmt.Fprintf(out, "ledger schema is current (version %d)\n", migrate.Version())
		}
		return nil
	}
	if e.JSON() {
		list := make([]map[string]any, len(pending))
		for i, m := range pending {
			list[i] = map[string]any{"version": m.Version, "name": m.Name, "no_transaction": m.NoTransaction,
				"additive": m.Additive, "sql": m.SQL}
		}
		return printJSON(out, map[string]any{"migrations": list})
	}
	if len(pending) == 0 {
		fmt.Fprintf(out, "-- the ledger schema is current (version %d): nothing to run\n", migrate.Version())
		return nil
	}
	fmt.Fprint(out, migrate.Script(pending))
	return nil
}

func healthcheckCmd(e *Env) *cobra.Command {
	var timeout time.Duration
	cmd := &cobra.Command{
		Use:   "healthcheck",
		Short: "Exit 0 when Redis and Postgres answer and the ledger schema is current; otherwise print why and exit 1",
		Long: `Check what every keel process needs: Redis answers (the URL's database
exists), Postgres answers, and the ledger's schema is one this program can
use. For container health checks: the image needs no shell.`,
		Example: `  healthcheck: {test: ["CMD", "keel", "healthcheck"], interval: 10s}`,
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if timeout <= 0 {
				return usageError{fmt.Errorf("--timeout must be a positive duration like 5s")}
			}
			ctx, cancel := context.WithTimeout(cmd.Context(), timeout)
			defer cancel()
			failed := func(err error) error {
				if e.JSON() {
					// A script reading stdout gets an answer too; the exit
					// status and the line on stderr are as without --json.
					_ = printJSON(cmd.OutOrStdout(), map[string]any{"ok": false, "error": err.Error()})
				}
				return err
			}
			if _, err := e.Redis(ctx); err != nil {
				return failed(err)
			}
			pool, err := e.Ledger(ctx)
			if err != nil {
				return failed(err)
			}
			pool.Close()
			if e.JSON() {
				return printJSON(cmd.OutOrStdout(), map[string]any{"ok": true, "ledger_schema": migrate.Version()})
			}
			fmt.Fprintf(cmd.OutOrStdout(), "ok: Redis and Postgres answer, ledger schema %d\n", migrate.Version())
			return nil
		},
	}
	cmd.Flags().DurationVar(&timeout, "timeout", 5*time.Second, "give up after this long")
	return cmd
}

func workerCmd(e *Env) *cobra.Command {
	w := &WorkerFlags{}
	lf := &limitFlags{}
	of := &observeFlags{}
	cmd := &cobra.Command{
		Use:   "worker",
		Short: "Run a worker for this program's handlers",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg, err := w.Config()
			if err != nil {
				return err
			}
			// Every flag is checked before anything is connected to.
			rules, err := lf.rules(e.app)
			if err != nil {
				return err
			}
			if e.app.Register == nil {
				return usageError{fmt.Errorf("%s has no handlers to run: build your own binary with the cli package (see the README, \"Your own worker binary\")", e.app.name())}
			}
			ctx := cmd.Context()
			// Each running handler may hold a connection: pgx's default
			// (max(4, cores)) would cap the concurrency at that.
			e.poolConns = server.PoolSize(cfg.Concurrency)
			svc, err := e.Open(ctx)
			if err != nil {
				return err
			}
			defer svc.Close()
			cfg.Redis, cfg.Pool, cfg.Logger, cfg.Kinds = svc.Redis, svc.Pool, svc.Log, e.app.Kinds
			mux := tasks.NewMux()
			if err := e.app.Register(mux, svc); err != nil {
				return err
			}
			warnUnhandled(svc.Log, e.app.Kinds, mux, cfg.Queues)
			rules = ruleKinds(svc.Log, rules, mux.Kinds())
			if len(rules) > 0 {
				limits, err := flow.New(flow.Config{Redis: svc.Redis, Rules: rules, Logger: svc.Log})
				if err != nil {
					return usageError{err}
				}
				defer limits.Close()
				cfg.Middleware = append(cfg.Middleware, limits.Middleware)
			}
			ob, err := of.wire(&cfg, nil, svc.Log, e.app.Kinds)
			if err != nil {
				return err
			}
			srv, err := server.New(cfg, mux)
			if err != nil {
				return usageError{err}
			}
			ob.Attach(srv)
			var wg sync.WaitGroup
			octx, stop := context.WithCancel(ctx)
			defer func() { stop(); wg.Wait() }()
			if err := ob.Run(octx, &wg); err != nil {
				srv.Close()
				return err
			}
			return srv.Run(ctx)
		},
	}
	w.Bind(cmd)
	lf.bind(cmd)
	of.bind(cmd)
	return cmd
}

func relayCmd(e *Env) *cobra.Command {
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
			svc, err := e.Open(ctx)
			if err != nil {
				return err
			}
			defer svc.Close()
			log := svc.Log
			cfg.Pool, cfg.Redis, cfg.Logger = svc.Pool, svc.Redis, log
			r, err := outbox.NewRelay(cfg)
			if err != nil {
				return err
			}
			defer r.Close()
			var wg sync.WaitGroup
			if !noReconcile {
				rcfg.Pool, rcfg.Redis, rcfg.Logger = svc.Pool, svc.Redis, log
				rec, err := outbox.NewReconciler(rcfg)
				if err != nil {
					return err
				}
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

// lookupHint says what a look-up that found nothing may have got wrong: the
// shape of the kind's keys (order:123, not 123), or that the ledger has no
// job of that kind at all, and which kinds it has.
func lookupHint(ctx context.Context, pool *pgxpool.Pool, kind string) string {
	key, err := ledger.NewestKeyOfKind(ctx, pool, kind)
	if err == nil {
		return fmt.Sprintf(" (its newest job's key is %q)", visible.Text(key))
	}
	if !errors.Is(err, pgx.ErrNoRows) {
		return ""
	}
	kinds, err := ledger.Kinds(ctx, pool)
	if err != nil {
		return ""
	}
	if len(kinds) == 0 {
		return " (the ledger holds no jobs)"
	}
	for i, k := range kinds {
		kinds[i] = visible.Text(k)
	}
	return fmt.Sprintf(" (the ledger holds no job of that kind; its kinds: %s)", strings.Join(kinds, ", "))
}

func statusCmd(e *Env) *cobra.Command {
	var id string
	cmd := &cobra.Command{
		Use:   "status [KIND BUSINESS_KEY]",
		Short: "Show what state a business action's job is in, who holds it, and when it retries",
		Example: "  keel status order:send_receipt order:123\n" +
			"  keel status --id 01936f3e-...",
		RunE: func(cmd *cobra.Command, args []string) error {
			if (id == "") == (len(args) != 2) {
				return usageError{fmt.Errorf("give KIND and BUSINESS_KEY, or --id")}
			}
			if len(args) == 2 && (strings.TrimSpace(args[0]) == "" || args[1] == "") {
				return usageError{fmt.Errorf("KIND and BUSINESS_KEY must not be empty (an unset shell variable?)")}
			}
			if id != "" {
				u, err := uuid.Parse(strings.TrimSpace(id))
				if err != nil {
					return usageError{fmt.Errorf("--id %q is malformed: a job id is a UUID like 01936f3e-8c1a-7b2e-9f00-1a2b3c4d5e6f", id)}
				}
				id = u.String() // as the ledger keeps it
			}
			ctx := cmd.Context()
			pool, err := e.Ledger(ctx)
			if err != nil {
				return err
			}
			defer pool.Close()
			store := jobstore.NewStore(pool)
			var job idempotency.Job
			if id != "" {
				job, err = store.Get(ctx, id)
				if errors.Is(err, idempotency.ErrNotFound) {
					return fmt.Errorf("no job with id %s: %w", id, err)
				}
			} else {
				job, err = store.Lookup(ctx, args[0], args[1])
				if errors.Is(err, idempotency.ErrNotFound) {
					return fmt.Errorf("no job of kind %q with business key %q%s: %w", args[0], args[1], lookupHint(ctx, pool, args[0]), err)
				}
			}
			if err != nil {
				return err
			}
			steps, err := store.Steps(ctx, job.ID)
			if err != nil {
				return err
			}
			out, err := readOutput(ctx, store, job)
			if err != nil {
				return err
			}
			deps, err := loadDeps(ctx, pool, job)
			if err != nil {
				return err
			}
			if e.JSON() {
				sj := toStatusJSON(job, steps).with(out)
				sj.Dependencies = deps
				return printJSON(cmd.OutOrStdout(), sj)
			}
			printStatus(cmd.OutOrStdout(), e.app.name(), job, steps, out)
			printDeps(cmd.OutOrStdout(), e.app.name(), job, deps)
			markSeen(cmd, job, func(by string) (int, error) { return ledger.MarkSeen(ctx, pool, []string{job.ID}, by, nil) })
			return nil
		},
	}
	cmd.Flags().StringVar(&id, "id", "", "look up by job id instead")
	return cmd
}

type stepJSON struct {
	Name   string `json:"name"`
	Status string `json:"status"`
	Calls  int    `json:"calls"`
	Result string `json:"result,omitempty"`
	// Verifiable: a started step its handler's Verify settles on replay;
	// false for a started step, a person says whether it happened.
	Verifiable bool       `json:"verifiable"`
	StartedAt  time.Time  `json:"started_at"`
	FinishedAt *time.Time `json:"finished_at,omitempty"`
}

type statusJSON struct {
	ID           string     `json:"id"`
	Kind         string     `json:"kind"`
	BusinessKey  string     `json:"business_key"`
	Queue        string     `json:"queue"`
	Status       string     `json:"status"`
	Attempts     int        `json:"attempts"`
	MaxRetry     int        `json:"max_retry"`
	ExtraRuns    int        `json:"extra_runs,omitempty"`
	LastError    string     `json:"last_error,omitempty"`
	ErrorClass   string     `json:"error_class,omitempty"`
	LeaseHolder  string     `json:"lease_holder,omitempty"`
	LeaseUntil   *time.Time `json:"lease_until,omitempty"`
	RunAt        time.Time  `json:"run_at"`
	PublishedAt  *time.Time `json:"published_at,omitempty"`
	CreatedAt    time.Time  `json:"created_at"`
	UpdatedAt    time.Time  `json:"updated_at"`
	FinishedAt   *time.Time `json:"finished_at,omitempty"`
	SupersededAt *time.Time `json:"superseded_at,omitempty"`
	// EffectsCommittedAt: the completing InTx committed, then the handler
	// failed; the job is not replayable.
	EffectsCommittedAt *time.Time `json:"effects_committed_at,omitempty"`
	PayloadSummary     string     `json:"payload_summary,omitempty"`
	TraceID            string     `json:"trace_id,omitempty"`
	ResolutionNote     string     `json:"resolution_note,omitempty"`
	ResolvedBy         string     `json:"resolved_by,omitempty"`
	NextRetryAt        *time.Time `json:"next_retry_at,omitempty"`
	Steps              []stepJSON `json:"steps"`
	// Dependencies: what the job waits (or waited) for, and what waits
	// for it; absent for a job with none.
	Dependencies *depsJSON `json:"dependencies,omitempty"`
	// HeldBy names the pauses that hold a paused job ("kind", "queue";
	// empty when neither stands any more); absent for other statuses.
	HeldBy []string `json:"held_by,omitzero"`
	// Progress is what its handler last reported (of the run numbered
	// in it); Result what it stored with its success.
	Progress *progressJSON   `json:"progress,omitempty"`
	Result   json.RawMessage `json:"result,omitempty"`
	// ConcurrencyKey: the job's tenant under its kind's limit;
	// KeyHeldSince: set while it waits for a slot of that key.
	ConcurrencyKey string     `json:"concurrency_key,omitempty"`
	KeyHeldSince   *time.Time `json:"key_held_since,omitempty"`
}

type progressJSON struct {
	Done      int64     `json:"done"`
	Total     int64     `json:"total"`
	Note      string    `json:"note,omitempty"`
	Run       int       `json:"run"`
	UpdatedAt time.Time `json:"updated_at"`
}

// jobOutput is what a job's handler reported and stored: its progress and
// its result, each nil when it has none.
type jobOutput struct {
	progress *idempotency.JobProgress
	result   *idempotency.JobResult
	// heldBy names the pauses that hold a paused job: "kind", "queue".
	heldBy []string
}

// readOutput reads job j's progress, and its result if it succeeded.
func readOutput(ctx context.Context, store *jobstore.Store, j idempotency.Job) (jobOutput, error) {
	var out jobOutput
	p, ok, err := store.Progress(ctx, j.ID)
	if err != nil {
		return out, err
	}
	if ok {
		out.progress = &p
	}
	if j.Status == idempotency.StatusPaused {
		kind, queue, err := ledger.PausesHolding(ctx, store.Pool(), j.Kind, j.Queue)
		if err != nil {
			return out, err
		}
		out.heldBy = []string{}
		if kind {
			out.heldBy = append(out.heldBy, "kind")
		}
		if queue {
			out.heldBy = append(out.heldBy, "queue")
		}
	}
	if j.Status == idempotency.StatusSucceeded {
		r, err := store.Result(ctx, j.ID)
		switch {
		case err == nil:
			out.result = &r
		case !errors.Is(err, idempotency.ErrNoResult):
			return out, err
		}
	}
	return out, nil
}

func (s statusJSON) with(out jobOutput) statusJSON {
	if p := out.progress; p != nil {
		s.Progress = &progressJSON{Done: p.Done, Total: p.Total, Note: p.Note, Run: p.Run, UpdatedAt: p.UpdatedAt}
	}
	if out.result != nil {
		s.Result = out.result.JSON
	}
	s.HeldBy = out.heldBy
	return s
}

// progressText is a report as a person reads it: "40/100 (40%) copying".
func progressText(p idempotency.JobProgress) string {
	s := fmt.Sprintf("%d", p.Done)
	if p.Total > 0 {
		s = fmt.Sprintf("%d/%d (%d%%)", p.Done, p.Total, p.Done*100/p.Total)
	}
	if p.Note != "" {
		s += " " + p.Note
	}
	return s
}

// maxResultShown bounds the result `status` prints; --json prints it whole.
const maxResultShown = 2000

func toStatusJSON(j idempotency.Job, steps []idempotency.StepRecord) statusJSON {
	out := statusJSON{ID: j.ID, Kind: j.Kind, BusinessKey: j.BusinessKey, Queue: j.Queue, Status: string(j.Status),
		Attempts: j.Attempts, MaxRetry: j.MaxRetry, ExtraRuns: j.ExtraRuns, LastError: j.LastError, ErrorClass: j.ErrorClass,
		LeaseHolder: j.LeaseHolder, LeaseUntil: j.LeaseUntil, RunAt: j.RunAt, PublishedAt: j.PublishedAt,
		CreatedAt: j.CreatedAt, UpdatedAt: j.UpdatedAt, FinishedAt: j.FinishedAt, SupersededAt: j.SupersededAt, PayloadSummary: j.PayloadSummary,
		EffectsCommittedAt: j.EffectsCommittedAt,
		TraceID:            j.TraceID, ResolutionNote: j.ResolutionNote, ResolvedBy: j.ResolvedBy, NextRetryAt: nextRetry(j), Steps: []stepJSON{},
		ConcurrencyKey: j.ConcurrencyKey, KeyHeldSince: j.KeyHeldSince}
	for _, s := range steps {
		out.Steps = append(out.Steps, stepJSON{Name: s.Name, Status: s.Status, Calls: s.Calls, Result: string(s.Result),
			Verifiable: s.Verifiable, StartedAt: s.StartedAt, FinishedAt: s.FinishedAt})
	}
	return out
}

// printStatus writes job j and its steps for a person; prog is this
// program's name, in the commands it suggests.
func printStatus(w io.Writer, prog string, j idempotency.Job, steps []idempotency.StepRecord, out jobOutput) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	// A line break or tab in a job's text would start a row or a column of
	// its own ("status  succeeded" in a business key): names and keys show
	// them as codes, and the further lines of a multi-line text (an error, a
	// note) are indented under their row.
	row := func(k, v string) {
		if v == "" {
			return
		}
		for i, line := range strings.Split(strings.ReplaceAll(v, "\t", "    "), "\n") {
			if i == 0 {
				fmt.Fprintf(tw, "%s\t%s\n", oneRow(k), line)
			} else {
				fmt.Fprintf(tw, "\t%s\n", line)
			}
		}
	}
	one := func(k, v string) { row(k, oneRow(v)) }
	ts := func(t *time.Time) string {
		if t == nil {
			return ""
		}
		return t.Format(time.RFC3339)
	}
	row("job", j.ID)
	one("kind", j.Kind)
	one("business key", j.BusinessKey)
	one("queue", j.Queue)
	row("status", string(j.Status))
	one("concurrency key", j.ConcurrencyKey)
	if j.Status == idempotency.StatusPaused {
		row("held", pausedText(prog, j, out.heldBy))
	}
	if j.HeldForKey() {
		row("held", fmt.Sprintf("since %s: waiting for a slot of its concurrency key; it is published when one of the key's jobs ends (keel keys ls --kind %s)",
			j.KeyHeldSince.Format(time.RFC3339), oneRow(j.Kind)))
	}
	budget := fmt.Sprintf("max retry %d", j.MaxRetry)
	if n, ok := j.DefaultPolicyRetries(); ok {
		budget += fmt.Sprintf("; its error is unclassified: with the default retry policy it gets %d retries and dies after attempt %d", n, n+1)
	}
	if j.ExtraRuns > 0 {
		budget += fmt.Sprintf("; %d run(s) added by keel, since a run crashed beside other jobs: it runs alone before it can be retired as a poison job", j.ExtraRuns)
	}
	row("attempts", fmt.Sprintf("%d (%s)", j.Attempts, budget))
	if j.Status == idempotency.StatusFailed || j.Status == idempotency.StatusDead {
		row("last error", j.LastError)
		row("error class", j.ErrorClass)
	} else if j.LastError != "" {
		// A replayed or closed job keeps its last error: history, not why it
		// stands where it is (the dashboard's "Earlier error").
		row("earlier error", fmt.Sprintf("%s (%s; from an earlier attempt, the job has moved on since)", j.LastError, j.ErrorClass))
	}
	if j.LeaseHolder != "" {
		lease := fmt.Sprintf("%s until %s", j.LeaseHolder, ts(j.LeaseUntil))
		if j.Status == idempotency.StatusRunning && j.LeaseUntil != nil && time.Now().After(*j.LeaseUntil) {
			// As the dashboard says: nobody holds it now.
			lease += " (expired: the worker probably died; the next delivery takes the job over)"
		}
		one("lease", lease)
	}
	if next := nextRetry(j); next != nil {
		row("next retry", fmt.Sprintf("%s (in %s)", next.Format(time.RFC3339), max(0, time.Until(*next)).Round(time.Second)))
	}
	row("run at", j.RunAt.Format(time.RFC3339))
	row("published", ts(j.PublishedAt))
	row("created", j.CreatedAt.Format(time.RFC3339))
	row("updated", j.UpdatedAt.Format(time.RFC3339))
	row("finished", ts(j.FinishedAt))
	if j.SupersededAt != nil {
		row("superseded", ts(j.SupersededAt)+" (a newer job of this key took its place)")
	}
	if j.EffectsCommittedAt != nil {
		row("effects committed", ts(j.EffectsCommittedAt)+" (its completing InTx committed before the handler failed: not replayable)")
	}
	if p := out.progress; p != nil {
		when := "reported"
		if j.Status != idempotency.StatusRunning {
			when = "last reported"
		}
		one("progress", fmt.Sprintf("%s (%s %s, by run %d)", visible.Text(progressText(*p)), when, p.UpdatedAt.Format(time.RFC3339), p.Run))
	}
	if r := out.result; r != nil {
		text := string(r.JSON)
		if len(text) > maxResultShown {
			text = jobstore.StorableText(text, maxResultShown) + fmt.Sprintf(" (%d bytes in all: --json shows it whole)", len(r.JSON))
		}
		one("result", visible.Text(text))
	}
	row("payload summary", j.PayloadSummary)
	one("trace id", j.TraceID)
	row("resolution", j.ResolutionNote)
	one("resolved by", j.ResolvedBy)
	for _, s := range steps {
		switch {
		case s.Status == "started" && j.Status == idempotency.StatusDead:
			how := fmt.Sprintf("say which with: %s dead resolve %s %s --happened | --not-happened", prog, j.ID, shellWord(s.Name))
			switch {
			case s.Verifiable:
				how = fmt.Sprintf("its handler's Verify settles it when the job runs again: %s dead replay %s", prog, j.ID)
			case strings.ContainsFunc(s.Name, visible.Hidden), strings.ContainsAny(s.Name, "\n\t"):
				how = "say which on the job's dashboard page (the step's name has characters a terminal would act on)"
			}
			row("step "+s.Name, fmt.Sprintf("in doubt: its call may or may not have happened (calls %d, started %s, key %s); %s",
				s.Calls, s.StartedAt.Format(time.RFC3339), oneRow(idempotency.StepKey(j.ID, s.Name)), how))
		case s.FinishedAt == nil:
			row("step "+s.Name, fmt.Sprintf("%s (calls %d, started %s)", s.Status, s.Calls, s.StartedAt.Format(time.RFC3339)))
		default:
			row("step "+s.Name, fmt.Sprintf("%s (calls %d, started %s, finished %s)", s.Status, s.Calls, s.StartedAt.Format(time.RFC3339), ts(s.FinishedAt)))
		}
	}
	tw.Flush()
}

// pausedText says which pauses hold a paused job and how to lift them, as
// the dashboard's job page does.
func pausedText(prog string, j idempotency.Job, heldBy []string) string {
	kind, queue := slices.Contains(heldBy, "kind"), slices.Contains(heldBy, "queue")
	k, q := oneRow(j.Kind), oneRow(j.Queue)
	resumeKind := fmt.Sprintf("%s kind resume %s", prog, shellWord(j.Kind))
	resumeQueue := fmt.Sprintf("%s queue resume %s", prog, shellWord(j.Queue))
	switch {
	case kind && queue:
		return fmt.Sprintf("its kind %s and its queue %s are paused: no worker starts it until both resume (%s; %s)", k, q, resumeKind, resumeQueue)
	case queue:
		return fmt.Sprintf("its queue %s is paused, and Redis, which had lost the pause, delivered it: no worker starts it until the queue resumes (%s)", q, resumeQueue)
	case kind:
		return fmt.Sprintf("its kind %s is paused: no worker starts it until the kind resumes (%s)", k, resumeKind)
	default:
		return fmt.Sprintf("neither its kind %s nor its queue %s is paused any more, yet it is held (a pause removed by hand?): resuming either releases it (%s, or %s)", k, q, resumeKind, resumeQueue)
	}
}

// oneRow shows the line breaks and tabs of a name or key as codes, as
// internal/visible shows other control characters, so that it stays on its
// row.
func oneRow(s string) string {
	return strings.NewReplacer("\n", "[U+000A]", "\t", "[U+0009]").Replace(s)
}

// shellWord quotes s for a POSIX shell unless it needs no quoting; one
// that holds a control character is quoted as $'…' (bash, zsh, ksh).
func shellWord(s string) string {
	if s != "" && !strings.ContainsFunc(s, func(r rune) bool {
		return !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || strings.ContainsRune("-_.:/@%+=,", r))
	}) {
		return s
	}
	if !strings.ContainsFunc(s, isControl) {
		return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
	}
	// A control character would break the suggested command over lines
	// (or ring a bell): ANSI-C quoting (bash, zsh, ksh) writes it as an
	// escape.
	var b strings.Builder
	b.WriteString("$'")
	for i := 0; i < len(s); i++ {
		switch c := s[i]; {
		case c == '\\' || c == '\'':
			b.WriteByte('\\')
			b.WriteByte(c)
		case c < 0x20 || c == 0x7f:
			fmt.Fprintf(&b, `\x%02x`, c)
		default:
			b.WriteByte(c)
		}
	}
	b.WriteByte('\'')
	return b.String()
}

func isControl(r rune) bool { return r < 0x20 || r == 0x7f }

// nextRetry is when a job waiting to retry runs again: the ledger's run_at
// of a failed job. Nil for any other status.
func nextRetry(j idempotency.Job) *time.Time {
	if j.Status != idempotency.StatusFailed {
		return nil
	}
	t := j.RunAt
	return &t
}

// warnUnhandled names declared kinds whose queue this worker reads but
// for which Register put no handler on the mux: their jobs would fail here
// as unknown kinds (and be retried until a worker that has one takes them).
func warnUnhandled(log *slog.Logger, kinds *tasks.Kinds, mux *tasks.Mux, queues map[string]int) {
	handled := map[string]bool{}
	for _, k := range mux.Kinds() {
		handled[k] = true
	}
	if len(queues) == 0 {
		queues = server.DefaultQueues()
	}
	for _, k := range kinds.All() {
		if _, reads := queues[k.Queue()]; reads && !handled[k.Name()] {
			log.Warn("keel worker: a declared kind has no handler, and this worker reads its queue: its jobs will fail here",
				"kind", k.Name(), "queue", k.Queue())
		}
	}
}
