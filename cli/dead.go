package cli

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"os/user"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"
	"github.com/spf13/cobra"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/inspect"
	"github.com/keeljobs/keel/internal/jobstore"
	"github.com/keeljobs/keel/internal/visible"
	"github.com/keeljobs/keel/retry"
	"github.com/keeljobs/keel/web"
)

// deadFlags are the dead-letter filters shared by ls, replay and discard.
type deadFlags struct {
	kind, queue, class string
	since, until       string
	dryRun             bool
	yes                bool
	actor, note        string
	limit              int
}

func (d *deadFlags) bindFilter(cmd *cobra.Command) {
	f := cmd.Flags()
	f.StringVar(&d.kind, "kind", "", "only this kind")
	f.StringVar(&d.queue, "queue", "", "only this queue")
	f.StringVar(&d.class, "class", "", "only this error class ("+strings.Join(classNames(), ", ")+")")
	f.StringVar(&d.since, "since", "", "died at or after: RFC 3339 time or a duration ago (e.g. 2h)")
	f.StringVar(&d.until, "until", "", "died before: RFC 3339 time or a duration ago")
}

func (d *deadFlags) bindAction(cmd *cobra.Command, needNote bool) {
	f := cmd.Flags()
	f.StringVar(&d.actor, "actor", defaultActor(), "who is acting (kept in the audit log)")
	usage := "why (kept in the audit log)"
	if needNote {
		usage = "why (required; kept with the job and in the audit log)"
	}
	f.StringVar(&d.note, "note", "", usage)
	f.BoolVar(&d.dryRun, "dry-run", false, "show what would be done, change nothing")
	f.BoolVar(&d.yes, "yes", false, "do not ask for confirmation of a bulk action")
}

func defaultActor() string {
	name := "unknown"
	if u, err := user.Current(); err == nil {
		name = u.Username
	}
	host, _ := os.Hostname()
	return "cli:" + name + "@" + host
}

func parseWhen(s string) (time.Time, error) {
	if s == "" {
		return time.Time{}, nil
	}
	if d, err := time.ParseDuration(s); err == nil {
		return time.Now().Add(-d), nil
	}
	t, err := time.Parse(time.RFC3339, s)
	if err != nil {
		return time.Time{}, usageError{fmt.Errorf("%q is neither an RFC 3339 time nor a duration", s)}
	}
	return t, nil
}

func classNames() []string {
	var names []string
	for _, c := range retry.StoredClasses() {
		names = append(names, string(c))
	}
	return names
}

func (d *deadFlags) filter() (inspect.Filter, error) {
	// As the dashboard's filter does: a pasted " order:x" means order:x.
	d.kind, d.queue, d.class = strings.TrimSpace(d.kind), strings.TrimSpace(d.queue), strings.TrimSpace(d.class)
	if d.class != "" && !slices.Contains(classNames(), d.class) {
		return inspect.Filter{}, usageError{fmt.Errorf("--class %q: no such class; dead jobs carry %s", d.class, strings.Join(classNames(), ", "))}
	}
	since, err := parseWhen(d.since)
	if err != nil {
		return inspect.Filter{}, err
	}
	until, err := parseWhen(d.until)
	if err != nil {
		return inspect.Filter{}, err
	}
	switch now := time.Now(); {
	case !since.IsZero() && since.After(now):
		return inspect.Filter{}, usageError{fmt.Errorf("--since %q is in the future: no job died then", d.since)}
	case !since.IsZero() && !until.IsZero() && !until.After(since):
		return inspect.Filter{}, usageError{fmt.Errorf("--until %q is not after --since %q: the window is empty (a duration counts back from now: --since 3h --until 2h)", d.until, d.since)}
	}
	return inspect.Filter{Kind: d.kind, Queue: d.queue, Class: d.class, Since: since, Until: until}, nil
}

func deadCmd(e *Env) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "dead",
		Short: "See, replay and discard dead jobs (kept in the ledger until a person closes them)",
	}
	cmd.AddCommand(deadLsCmd(e), deadShowCmd(e), deadActionCmd(e, "replay"), deadActionCmd(e, "discard"), deadResolveCmd(e))
	return cmd
}

// deadResolveCmd records a person's verdict on a dead job's step in doubt,
// as the dashboard's job page does.
func deadResolveCmd(e *Env) *cobra.Command {
	var actor, note string
	var happened, notHappened bool
	cmd := &cobra.Command{
		Use:   "resolve JOB_ID STEP (--happened | --not-happened)",
		Short: "Say whether a dead job's step in doubt happened, so that it can be replayed",
		Long: `Say whether the call of a dead job's step in doubt happened: its worker died
mid-call, or the call failed in a way that may come after its effect. Check
the other side first (the step's idempotency key is JOB_ID:STEP).

  --happened      the step is done: a replay skips it
  --not-happened  the step is forgotten: a replay calls it again, with the same key

Then replay the job (keel dead replay JOB_ID).`,
		Example: "  keel dead resolve 01936f3e-8c1a-7b2e-9f00-1a2b3c4d5e6f charge --not-happened --note \"no charge at the provider\"",
		Args:    cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := checkJobIDs(args[:1]); err != nil {
				return err
			}
			switch {
			case happened && notHappened:
				return usageError{errors.New("--happened and --not-happened: say one, not both")}
			case !happened && !notHappened:
				return usageError{errors.New("say whether the step's call happened: --happened or --not-happened")}
			}
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
			if err := ops.ResolveStep(ctx, args[0], args[1], happened, actor, note); err != nil {
				return err
			}
			out := cmd.OutOrStdout()
			if e.JSON() {
				return printJSON(out, map[string]any{"id": args[0], "step": args[1], "happened": happened})
			}
			verdict := "did not happen: a replay calls it again, with the same key"
			if happened {
				verdict = "happened: a replay skips it"
			}
			fmt.Fprintf(out, "job %s step %s %s\n", args[0], args[1], verdict)
			return nil
		},
	}
	f := cmd.Flags()
	f.BoolVar(&happened, "happened", false, "the call happened: mark the step done")
	f.BoolVar(&notHappened, "not-happened", false, "the call did not happen: forget the step")
	f.StringVar(&actor, "actor", defaultActor(), "who is deciding (kept in the audit log)")
	f.StringVar(&note, "note", "", "why (kept in the audit log)")
	return cmd
}

func deadLsCmd(e *Env) *cobra.Command {
	d := &deadFlags{}
	cmd := &cobra.Command{
		Use:   "ls",
		Short: "List dead jobs, newest first",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if d.limit < 1 || d.limit > 1000 {
				return usageError{fmt.Errorf("--limit %d: between 1 and 1000", d.limit)}
			}
			f, err := d.filter()
			if err != nil {
				return err
			}
			ctx := cmd.Context()
			ops, pool, done, err := e.operator(ctx, false)
			if err != nil {
				return err
			}
			defer done()
			store := jobstore.NewStore(pool)
			total, err := ops.Count(ctx, f)
			if err != nil {
				return err
			}
			jobs, err := ops.List(ctx, f, d.limit, 0)
			if err != nil {
				return err
			}
			out := cmd.OutOrStdout()
			if e.JSON() {
				ids := make([]string, len(jobs))
				for i, j := range jobs {
					ids[i] = j.ID
				}
				steps, err := store.StepsOf(ctx, ids)
				if err != nil {
					return err
				}
				list := make([]statusJSON, 0, len(jobs))
				for _, j := range jobs {
					list = append(list, toStatusJSON(j, steps[j.ID]))
				}
				return printJSON(out, map[string]any{"total": total, "jobs": list})
			}
			tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
			fmt.Fprintln(tw, "DIED\tJOB\tKIND\tBUSINESS KEY\tCLASS\tATTEMPTS\tLAST ERROR")
			for _, j := range jobs {
				died := ""
				if j.FinishedAt != nil {
					died = j.FinishedAt.Format(time.RFC3339)
				}
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%d\t%s\n", died, j.ID, oneLine(j.Kind, 60), oneLine(j.BusinessKey, 40),
					j.ErrorClass, j.Attempts, oneLine(j.LastError, 80))
			}
			tw.Flush()
			fmt.Fprintf(out, "%d dead job(s) match; %d shown\n", total, len(jobs))
			return nil
		},
	}
	d.bindFilter(cmd)
	cmd.Flags().IntVar(&d.limit, "limit", 50, "show at most this many (up to 1000)")
	return cmd
}

func oneLine(s string, max int) string {
	s = strings.Join(strings.Fields(s), " ")
	if r := []rune(s); len(r) > max {
		return string(r[:max-1]) + "…"
	}
	return s
}

func deadShowCmd(e *Env) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "show JOB_ID",
		Short: "Show a job: reason, attempts, steps and the audit log",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := checkJobIDs(args[:1]); err != nil {
				return err
			}
			ctx := cmd.Context()
			ops, pool, done, err := e.operator(ctx, false)
			if err != nil {
				return err
			}
			defer done()
			store := jobstore.NewStore(pool)
			j, err := store.Get(ctx, args[0])
			if errors.Is(err, idempotency.ErrNotFound) {
				return fmt.Errorf("no job with id %s: %w", args[0], err)
			}
			if err != nil {
				return err
			}
			steps, err := store.Steps(ctx, j.ID)
			if err != nil {
				return err
			}
			audit, err := ops.Audit(ctx, j.ID)
			if err != nil {
				return err
			}
			// How far its last runs got, as status shows it.
			output, err := readOutput(ctx, store, j)
			if err != nil {
				return err
			}
			out := cmd.OutOrStdout()
			if e.JSON() {
				type auditJSON struct {
					Action string    `json:"action"`
					Actor  string    `json:"actor"`
					Note   string    `json:"note"`
					At     time.Time `json:"at"`
				}
				a := []auditJSON{}
				for _, x := range audit {
					a = append(a, auditJSON{x.Action, x.Actor, x.Note, x.At})
				}
				return printJSON(out, map[string]any{"job": toStatusJSON(j, steps).with(output), "audit": a})
			}
			printStatus(out, e.app.name(), j, steps, output)
			markSeen(cmd, j, func(by string) (int, error) { return ops.MarkSeen(ctx, []string{j.ID}, by) })
			for _, x := range audit {
				// A note's further lines are indented: at column 0 they
				// would read as entries of their own.
				note := strings.ReplaceAll(x.Note, "\n", "\n       ")
				fmt.Fprintf(out, "audit  %s  %s by %s: %s\n", x.At.Format(time.RFC3339), oneRow(x.Action), oneRow(x.Actor), note)
			}
			return nil
		},
	}
	return cmd
}

// checkNote bounds a note as the dashboard does: it is kept with the job
// and in its audit log, which every page showing the job carries.
func checkNote(note string) error {
	if n := utf8.RuneCountInString(note); n > web.MaxNoteChars {
		return usageError{fmt.Errorf("--note is %d characters; at most %d, as on the dashboard", n, web.MaxNoteChars)}
	}
	return nil
}

// actorNoteIDs checks what every action on jobs named by id takes (who,
// why, which) and returns the ids as the ledger keeps them, each once.
func actorNoteIDs(actor, note string, ids []string) ([]string, error) {
	if strings.TrimSpace(actor) == "" {
		return nil, usageError{inspect.ErrActorRequired}
	}
	if err := checkNote(note); err != nil {
		return nil, err
	}
	if err := checkJobIDs(ids); err != nil {
		return nil, err
	}
	return distinct(ids), nil
}

// actionError is an action's error when failed of n jobs were refused:
// the refusal itself when it named one job (first), else a count.
func actionError(failed, n int, first, done string) error {
	switch {
	case failed == 1 && n == 1:
		return errors.New(first)
	case failed > 0:
		return fmt.Errorf("%d job(s) could not be %s", failed, done)
	}
	return nil
}

// distinct is ids, each once, in their order: an id given twice is acted
// on once.
func distinct(ids []string) []string {
	seen := make(map[string]bool, len(ids))
	out := make([]string, 0, len(ids))
	for _, id := range ids {
		if !seen[id] {
			seen[id] = true
			out = append(out, id)
		}
	}
	return out
}

// checkJobIDs checks job ids and writes each back as the ledger keeps it:
// uuid.Parse takes upper case, no hyphens, braces and urn:uuid:, the
// ledger's ids are the lower-case hyphenated form.
func checkJobIDs(ids []string) error {
	for i, id := range ids {
		u, err := uuid.Parse(strings.TrimSpace(id))
		if err != nil {
			return usageError{fmt.Errorf("job id %q is malformed: a job id is a UUID like 01936f3e-8c1a-7b2e-9f00-1a2b3c4d5e6f", id)}
		}
		ids[i] = u.String()
	}
	return nil
}

// actionResult is what `dead replay` and `dead discard` print per job.
type actionResult struct {
	ID    string `json:"id"`
	Error string `json:"error,omitempty"`
	// Unchanged says why nothing was done: the job was not dead (replay),
	// or closed already (discard).
	Unchanged string `json:"unchanged,omitempty"`
}

// deadActionCmd builds `dead replay` and `dead discard`: by id, or every
// dead job a filter matches after a confirmation that shows the count.
func deadActionCmd(e *Env, action string) *cobra.Command {
	d := &deadFlags{}
	short := "Run dead jobs again through the same middleware and handler, with a fresh retry budget"
	if action == "discard" {
		short = "Close dead jobs for good, with a note saying why"
	}
	cmd := &cobra.Command{
		Use:   action + " [JOB_ID...]",
		Short: short,
		Long: short + ".\n\nName jobs by id, or select them with filters and --all; a bulk action shows the count\n" +
			"and asks for it back before it starts (--yes skips the question).",
		RunE: func(cmd *cobra.Command, args []string) error {
			all, _ := cmd.Flags().GetBool("all")
			if (len(args) == 0) == !all {
				return usageError{fmt.Errorf("name job ids, or select with filters and --all")}
			}
			if action == "discard" && strings.TrimSpace(d.note) == "" {
				return usageError{inspect.ErrNoteRequired}
			}
			args, err := actorNoteIDs(d.actor, d.note, args)
			if err != nil {
				return err
			}
			for _, name := range []string{"kind", "queue", "class", "since", "until"} {
				if !cmd.Flags().Changed(name) {
					continue
				}
				if !all {
					return usageError{fmt.Errorf("--%s selects jobs with --all; it does not apply to jobs named by id", name)}
				}
				// An empty filter selects every dead job: `--kind "$KIND"`
				// with KIND unset would act on all of them.
				if v, _ := cmd.Flags().GetString(name); strings.TrimSpace(v) == "" {
					return usageError{fmt.Errorf("--%s is empty, which would select every dead job: give a value, or leave the flag out to mean any", name)}
				}
			}
			f, err := d.filter()
			if err != nil {
				return err
			}
			ctx := cmd.Context()
			// Both actions touch asynq's copy of the job.
			ops, _, closeOps, err := e.operator(ctx, true)
			if err != nil {
				return err
			}
			defer closeOps()
			act := inspect.Action(action)
			var ids []string
			if !all {
				ids = args
			}
			if all {
				if ids, err = ops.IDs(ctx, f); err != nil {
					return err
				}
			}
			out := cmd.OutOrStdout()
			if d.dryRun {
				// Each job is looked at as the action would, those --all
				// selects too: one with a step in doubt or its effects in
				// is refused, not counted.
				checked, err := ops.Check(ctx, act, ids)
				if err != nil {
					return err
				}
				var skipped []actionResult
				var would []string
				for _, o := range checked {
					r := actionResult{ID: o.ID, Unchanged: unchangedNote(act, o.Unchanged)}
					switch {
					case errors.Is(o.Err, inspect.ErrNotFound):
						r.Error = "no job with this id"
					case o.Err != nil:
						r.Error = e.own(o.Err.Error())
					}
					if o.Would() {
						would = append(would, o.ID)
					} else {
						skipped = append(skipped, r)
					}
				}
				ids = would
				failing := 0
				for _, r := range skipped {
					if r.Error != "" {
						failing++
					}
				}
				if e.JSON() {
					if err := printJSON(out, map[string]any{"dry_run": true, "action": action, "count": len(ids), "ids": nonNil(ids), "skipped": nonNilResults(skipped)}); err != nil {
						return err
					}
				} else {
					for _, r := range skipped {
						if r.Error != "" {
							fmt.Fprintf(out, "%s %s: would fail: %s\n", action, r.ID, r.Error)
						} else {
							fmt.Fprintf(out, "%s %s: nothing to do: %s\n", action, r.ID, r.Unchanged)
						}
					}
					fmt.Fprintf(out, "dry run: would %s %d job(s); nothing was changed\n", action, len(ids))
				}
				if failing > 0 {
					return notDone(action, failing)
				}
				return nil
			}
			if !e.JSON() {
				fmt.Fprintf(out, "%s: %d job(s)\n", action, len(ids))
			}
			if all && !d.yes && len(ids) > 0 {
				if action == "replay" {
					dry, err := ops.DryRunMatching(ctx, act, f)
					if err != nil {
						return err
					}
					if refused := dry.RefusedTotal(); refused > 0 {
						fmt.Fprintf(cmd.ErrOrStderr(), "%d of them cannot be replayed (steps in doubt, effects committed, superseded) and stay dead; --dry-run names them\n", refused)
					}
				}
				fmt.Fprintf(cmd.ErrOrStderr(), "type %d to %s them: ", len(ids), action)
				line, _ := bufio.NewReader(cmd.InOrStdin()).ReadString('\n')
				if strings.TrimSpace(line) != strconv.Itoa(len(ids)) {
					return fmt.Errorf("not confirmed; nothing changed (--yes skips the question)")
				}
			}
			bar := newProgress(cmd.ErrOrStderr(), action, len(ids))
			told := map[string]bool{}
			tell := func(res inspect.BulkResult) {
				// As each page is done: its refusals and no-ops, in the
				// order the jobs were given.
				for _, id := range ids {
					if told[id] {
						continue
					}
					if why, ok := res.Failed[id]; ok {
						told[id] = true
						bar.clear()
						fmt.Fprintln(cmd.ErrOrStderr(), visible.Text(fmt.Sprintf("%s %s: %s", action, id, e.own(cancelHint(why, id)))))
					} else if why, ok := res.Unchanged[id]; ok {
						told[id] = true
						if !e.JSON() {
							bar.clear()
							fmt.Fprintf(out, "%s %s: nothing to do: %s\n", action, id, unchangedNote(act, why))
						}
					}
				}
				bar.set(res.Done + len(res.Unchanged) + len(res.Failed))
			}
			res, err := ops.Bulk(ctx, act, ids, d.actor, d.note, tell)
			if err != nil && res.Matched == 0 {
				return err
			}
			if len(ids) > 0 {
				bar.done()
			}
			results := make([]actionResult, 0, len(ids))
			for _, id := range ids {
				r := actionResult{ID: id, Unchanged: unchangedNote(act, res.Unchanged[id])}
				if why, ok := res.Failed[id]; ok {
					r.Error = e.own(cancelHint(why, id))
				}
				results = append(results, r)
			}
			failed, unchanged := len(res.Failed), len(res.Unchanged)
			done := res.Done
			if e.JSON() {
				if err := printJSON(out, map[string]any{"action": action, "done": done, "unchanged": unchanged, "failed": failed, "jobs": results}); err != nil {
					return err
				}
			} else {
				fmt.Fprintf(out, "%s: %d done, %d unchanged, %d failed\n", action, done, unchanged, failed)
			}
			if failed > 0 {
				return notDone(action, failed)
			}
			return err
		},
	}
	d.bindFilter(cmd)
	d.bindAction(cmd, action == "discard")
	cmd.Flags().Bool("all", false, "act on every dead job the filters match")
	return cmd
}

// notDone is the command's error when n jobs failed (or would fail).
func notDone(action string, n int) error {
	return fmt.Errorf("%d job(s) could not be %s", n, map[string]string{"replay": "replayed", "discard": "discarded"}[action])
}

// unchangedNote is what the CLI says of a job a discard had nothing to do
// to: the resolution it found stays.
func unchangedNote(a inspect.Action, why string) string {
	if why != "" && a == inspect.ActionDiscard {
		return why + " (that resolution stays; this note is not kept)"
	}
	return why
}

// cancelHint is why a job was refused, with what stops it when a discard
// was refused for a job that has not finished: discard closes dead jobs.
func cancelHint(why error, id string) string {
	var st *inspect.StatusError
	if errors.As(why, &st) && errors.Is(st.Err, inspect.ErrNotDead) && !st.Status.Terminal() && st.Status != idempotency.StatusDead {
		return why.Error() + "; discard closes dead jobs, a job that has not finished is stopped with `keel cancel " + id + "`"
	}
	return why.Error()
}

func nonNilResults(rs []actionResult) []actionResult {
	if rs == nil {
		return []actionResult{}
	}
	return rs
}

func nonNil(ids []string) []string {
	if ids == nil {
		return []string{}
	}
	return ids
}
