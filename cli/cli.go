// Package cli builds a keel command-line program around your own kinds and
// handlers: worker, scheduler, relay, migrate, enqueue, status, dead, ledger,
// web, version and healthcheck, with the same flags and environment as the
// stock keel binary.
//
//	func main() {
//		cli.Main(cli.App{
//			Name:  "welcome",
//			Kinds: tasks.NewKinds(SendWelcome),
//			Register: func(mux *tasks.Mux, _ *cli.Service) error {
//				tasks.Handle(mux, SendWelcome, sendWelcome)
//				return nil
//			},
//		})
//	}
package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/spf13/cobra"

	"github.com/keeljobs/keel/internal/visible"
	"github.com/keeljobs/keel/tasks"
)

// App describes a program built on keel. Only Register is needed for a
// worker; everything else has a default.
type App struct {
	// Name is the program's name in help and error messages. Default: the
	// executable's base name.
	Name string
	// Short is the one-line description shown by --help.
	Short string
	// Kinds are the kinds the program declares. When set, `enqueue`
	// refuses any other kind and a payload that does not decode into the
	// kind's payload type, the scheduler refuses entries naming another
	// kind, and the worker and the dashboard show the kinds' payloads
	// through their Summary. When empty, any kind is accepted: the program
	// only enqueues and inspects jobs other programs handle, and the
	// dashboard hides their payloads.
	Kinds *tasks.Kinds
	// Register puts the program's handlers on mux. `worker` calls it once
	// it has connected; svc holds the connections and the logger. Nil: the
	// program has no handlers, and `worker` refuses to start.
	Register func(mux *tasks.Mux, svc *Service) error
	// Migrate creates the program's own tables; `migrate` runs it after
	// the ledger's migrations. Nil: none.
	Migrate func(ctx context.Context, pool *pgxpool.Pool) error
	// Commands adds subcommands of the program's own. env reads the
	// connection flags every subcommand shares. They must not set a
	// PersistentPreRun: the root's checks the shared flags.
	Commands func(env *Env) []*cobra.Command
}

func (a App) name() string {
	if a.Name != "" {
		return a.Name
	}
	if exe, err := os.Executable(); err == nil {
		return filepath.Base(exe)
	}
	return "keel"
}

// known reports whether name is a kind of the program; every name is, when
// the program declares none.
func (a App) known(name string) bool {
	return len(a.Kinds.All()) == 0 || a.Kinds.Known(name)
}

func (a App) kindNames() []string {
	var names []string
	for _, k := range a.Kinds.All() {
		names = append(names, k.Name())
	}
	return names
}

// New returns the program's root command. Run it with ExecuteContext.
func New(app App) *cobra.Command {
	e := &Env{app: app}
	root := &cobra.Command{
		Use:           app.name(),
		Short:         app.Short,
		SilenceUsage:  true,
		SilenceErrors: true,
		PersistentPreRunE: func(cmd *cobra.Command, _ []string) error {
			if cmd.Annotations[groupAnnotation] != "" {
				return nil // it only prints its help, or names a mistake
			}
			return e.prepare(cmd)
		},
	}
	if root.Short == "" {
		root.Short = "Reliable background jobs: Asynq schedules, Postgres remembers"
	}
	e.bind(root)
	root.AddCommand(versionCmd(e), migrateCmd(e), workerCmd(e), relayCmd(e), enqueueCmd(e), statusCmd(e),
		ledgerCmd(e), deadCmd(e), cancelCmd(e), releaseCmd(e), workflowCmd(e), queueCmd(e), kindCmd(e), keysCmd(e), batchCmd(e), webCmd(e), schedulerCmd(e), healthcheckCmd(e),
		scheduleCmd(e))
	root.AddCommand(retentionCmd(e))
	if app.Commands != nil {
		root.AddCommand(app.Commands(e)...)
	}
	markUsageErrors(root)
	nameCommands(root, app.name())
	return root
}

// keelCommand matches "keel <one of its commands>" in a command's help.
var keelCommand = regexp.MustCompile("(^|[^\\w./-])keel (" + commandWords + ")\\b")

// commandWords are keel's own commands, as a regular expression.
const commandWords = "migrate|worker|relay|enqueue|status|ledger|dead|cancel|release|workflow|queue|kind|keys|batch|web|scheduler|schedule|healthcheck|version|retention"

// nameCommands puts the program's own name in the commands its help tells
// a person to run: a program built with this package under another name has
// no `keel dead replay`.
func nameCommands(c *cobra.Command, name string) {
	if name == "keel" {
		return
	}
	for _, text := range []*string{&c.Short, &c.Long, &c.Example} {
		*text = keelCommand.ReplaceAllString(*text, "${1}"+name+" $2")
	}
	for _, sub := range c.Commands() {
		nameCommands(sub, name)
	}
}

// groupAnnotation marks a command that only groups others (markUsageErrors).
const groupAnnotation = "keel:group"

// markUsageErrors makes the mistakes cobra finds in a command line usage
// errors (exit status 2), as keel's own checks are: a flag it does not know
// or cannot parse, arguments a command does not take, an unknown command.
func markUsageErrors(root *cobra.Command) {
	root.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return usageError{err} })
	var walk func(c *cobra.Command)
	walk = func(c *cobra.Command) {
		switch {
		case c.HasSubCommands() && c.Args == nil && c.Run == nil && c.RunE == nil:
			// A group such as `dead`: bare, it prints its help; a word
			// after it that names none of its commands is a mistake.
			if c.Annotations == nil {
				c.Annotations = map[string]string{}
			}
			c.Annotations[groupAnnotation] = "true"
			c.Args = func(cmd *cobra.Command, args []string) error {
				if len(args) == 0 {
					return nil
				}
				msg := fmt.Sprintf("unknown command %q for %q", args[0], cmd.CommandPath())
				if !cmd.DisableSuggestions {
					if cmd.SuggestionsMinimumDistance <= 0 {
						cmd.SuggestionsMinimumDistance = 2 // cobra's own default
					}
					if s := cmd.SuggestionsFor(args[0]); len(s) > 0 {
						msg += fmt.Sprintf(" (did you mean %s?)", strings.Join(s, ", "))
					}
				}
				return usageError{errors.New(msg)}
			}
			c.RunE = func(cmd *cobra.Command, _ []string) error { return cmd.Help() }
		case c.Args != nil:
			check := c.Args
			c.Args = func(cmd *cobra.Command, args []string) error {
				if err := check(cmd, args); err != nil {
					return usageError{err}
				}
				return nil
			}
		}
		for _, sub := range c.Commands() {
			walk(sub)
		}
	}
	walk(root)
}

// Main runs the program with os.Args, stops it on SIGTERM or SIGINT, prints
// an error as one line on stderr and exits: 0 on success, 2 for a usage
// error, 1 otherwise.
//
// With JSON output asked for (anywhere on the line, even after a flag that
// stopped parsing), a command that fails before printing anything
// prints {"error": "…", "usage_error": true|false} on stdout too, so that a
// script reading stdout gets JSON either way.
func Main(app App) {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	root := New(app)
	out := &countingWriter{w: os.Stdout}
	root.SetOut(out)
	err := root.ExecuteContext(ctx)
	stop()
	if err == nil {
		return
	}
	line := ErrorLine(app.name(), err)
	fmt.Fprintln(os.Stderr, line)
	if out.n == 0 && (jsonAsked(root) || jsonInArgs(os.Args[1:])) {
		_ = printJSON(os.Stdout, map[string]any{"error": line, "usage_error": IsUsageError(err)})
	}
	if IsUsageError(err) {
		os.Exit(2)
	}
	os.Exit(1)
}

// countingWriter counts what a command wrote.
type countingWriter struct {
	w io.Writer
	n int
}

func (c *countingWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n += n
	return n, err
}

// jsonAsked tells whether the command line asked for JSON output.
func jsonAsked(root *cobra.Command) bool {
	f := root.PersistentFlags()
	if j := f.Lookup("json"); j != nil && j.Value.String() == "true" {
		return true
	}
	o := f.Lookup("output")
	return o != nil && strings.EqualFold(o.Value.String(), "json")
}

// jsonInArgs tells whether args ask for JSON output as the flags would, so
// that a flag error before --json, which stops parsing, still answers JSON.
// The last word of several wins, as when the flags are parsed.
func jsonInArgs(args []string) bool {
	asked := false
	for i := 0; i < len(args); i++ {
		switch a := args[i]; {
		case a == "--":
			return asked
		case a == "--json":
			asked = true
		case strings.HasPrefix(a, "--json="):
			asked, _ = strconv.ParseBool(a[len("--json="):])
		case a == "--output" || a == "-o":
			if i++; i < len(args) {
				asked = strings.EqualFold(args[i], "json")
			}
		case strings.HasPrefix(a, "--output="):
			asked = strings.EqualFold(a[len("--output="):], "json")
		case strings.HasPrefix(a, "-o"):
			asked = strings.EqualFold(strings.TrimPrefix(a[len("-o"):], "="), "json")
		}
	}
	return asked
}

// ErrorLine is how Main prints err: one line, prefixed with the program's
// name, with job-supplied text made visible. A line the error repeats (pgx
// lists each attempt to connect, and it tries TLS, then plain) is printed
// once, and a prefix that already names the program ("keel web: …") is not
// doubled.
func ErrorLine(name string, err error) string {
	var parts []string
	for _, l := range strings.Split(err.Error(), "\n") {
		if l = strings.Join(strings.Fields(l), " "); l != "" && !slices.Contains(parts, l) {
			parts = append(parts, l)
		}
	}
	msg := strings.TrimPrefix(strings.Join(parts, " "), "keel: ")
	if w := strings.SplitN(msg, " ", 3); len(w) == 3 && w[0] == name && strings.HasSuffix(w[1], ":") {
		// Already the program's own prefix ("keel web: …").
		return visible.Text(msg)
	}
	return name + ": " + visible.Text(msg)
}

// usageError is a mistake in the command line or the environment: exit
// status 2.
type usageError struct{ error }

func (u usageError) Unwrap() error { return u.error }

// UsageError marks err as a mistake in the command line or environment, so
// that Main exits with status 2.
func UsageError(err error) error {
	if err == nil {
		return nil
	}
	return usageError{err}
}

// IsUsageError reports whether err was marked with UsageError.
func IsUsageError(err error) bool {
	var ue usageError
	return errors.As(err, &ue)
}
