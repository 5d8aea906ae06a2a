package cli

import (
	"context"
	"fmt"
	"strings"

	"github.com/spf13/cobra"

	"github.com/keeljobs/keel/inspect"
)

// pausable is what `keel queue`, `keel kind` and `keel schedule` pause and
// resume: each action is audited with who and why, and reports whether it
// changed anything.
type pausable struct {
	noun    string // in the output: "queue", "kind", "schedule entry"
	jsonKey string // the name's key in --json output
	arg     string // the argument in usage: QUEUE, KIND, NAME
	redis   bool   // the action needs Redis
	// The commands' help.
	pauseShort, resumeShort string
	pause, resume           func(ops *inspect.Inspector, ctx context.Context, name, actor, note string) (bool, error)
}

// pauseCommands returns the pause and resume subcommands of p, with their
// --actor and --note flags.
func pauseCommands(e *Env, p pausable) (pause, resume *cobra.Command) {
	var actor, note string
	action := func(resuming bool) func(cmd *cobra.Command, args []string) error {
		return func(cmd *cobra.Command, args []string) error {
			if strings.TrimSpace(actor) == "" {
				return usageError{inspect.ErrActorRequired}
			}
			if err := checkNote(note); err != nil {
				return err
			}
			ctx := cmd.Context()
			ops, _, done, err := e.operator(ctx, p.redis)
			if err != nil {
				return err
			}
			defer done()
			act, verb := p.pause, "paused"
			if resuming {
				act, verb = p.resume, "resumed"
			}
			changed, err := act(ops, ctx, args[0], actor, note)
			if err != nil {
				return err
			}
			if e.JSON() {
				return printJSON(cmd.OutOrStdout(), map[string]any{p.jsonKey: args[0], "action": strings.TrimSuffix(verb, "d"), "changed": changed})
			}
			if !changed {
				verb += " already"
			}
			fmt.Fprintf(cmd.OutOrStdout(), "%s %s: %s\n", p.noun, oneRow(args[0]), verb)
			return nil
		}
	}
	pause = &cobra.Command{Use: "pause " + p.arg, Short: p.pauseShort, Args: cobra.ExactArgs(1), RunE: action(false)}
	resume = &cobra.Command{Use: "resume " + p.arg, Short: p.resumeShort, Args: cobra.ExactArgs(1), RunE: action(true)}
	for _, c := range []*cobra.Command{pause, resume} {
		c.Flags().StringVar(&actor, "actor", defaultActor(), "who is acting (kept in the audit log)")
		c.Flags().StringVar(&note, "note", "", "why (kept in the audit log)")
	}
	return pause, resume
}
