package cli_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"

	"github.com/spf13/cobra"

	"github.com/keeljobs/keel/cli"
	"github.com/keeljobs/keel/server"
	"github.com/keeljobs/keel/tasks"
)

type Welcome struct {
	UserID string `json:"user_id"`
}

var SendWelcome = tasks.Define[Welcome]("user:send_welcome",
	tasks.Queue("default"), tasks.MaxRetry(5),
	tasks.Key(func(w Welcome) string { return "user:" + w.UserID }))

// welcomeApp is the program of every example: one kind and its handler.
func welcomeApp() cli.App {
	return cli.App{
		Name:  "welcome",
		Kinds: tasks.NewKinds(SendWelcome),
		Register: func(mux *tasks.Mux, _ *cli.Service) error {
			tasks.Handle(mux, SendWelcome, func(ctx context.Context, w Welcome) error {
				slog.InfoContext(ctx, "welcome", "user", w.UserID)
				return nil
			})
			return nil
		},
	}
}

// Your own worker binary: your kinds and handlers, and every keel
// subcommand for them (worker, enqueue, status, dead, web, …) with keel's
// flags and environment. Main reads os.Args and exits, so this example is
// not run here; examples/welcome is the same program.
func Example() {
	cli.Main(cli.App{
		Name:  "welcome",
		Kinds: tasks.NewKinds(SendWelcome),
		Register: func(mux *tasks.Mux, svc *cli.Service) error {
			// svc holds the worker's connections, for handlers that need them.
			tasks.Handle(mux, SendWelcome, func(ctx context.Context, w Welcome) error {
				svc.Log.InfoContext(ctx, "welcome", "user", w.UserID)
				return nil
			})
			return nil
		},
	})
}

// New gives the program's root command, to run a command line in-process
// (from a test, say). A dry run checks the job as enqueue would (the kind
// is declared, the payload decodes into its type, the key comes from the
// kind's Key) and needs neither Redis nor Postgres.
func ExampleNew() {
	root := cli.New(welcomeApp())
	root.SetArgs([]string{"enqueue", "user:send_welcome", "--payload", `{"user_id":"42"}`, "--dry-run"})
	if err := root.ExecuteContext(context.Background()); err != nil {
		fmt.Println(cli.ErrorLine("welcome", err))
	}
	// Output:
	// dry run: 1 job(s) checked; nothing was enqueued
	//   would enqueue user:send_welcome user:42 on queue default
}

// A subcommand of the program's own: env reads the flags every subcommand
// shares (--redis-url, --database-url, --log-level, …), and Open gives
// connections it has checked: Redis answers, the ledger's schema is one
// this binary can use.
func ExampleApp_commands() {
	app := welcomeApp()
	app.Commands = func(env *cli.Env) []*cobra.Command {
		return []*cobra.Command{{
			Use:   "welcome-all",
			Short: "Welcome every user not welcomed yet",
			Args:  cobra.NoArgs,
			RunE: func(cmd *cobra.Command, _ []string) error {
				ctx := cmd.Context()
				svc, err := env.Open(ctx)
				if err != nil {
					return err
				}
				defer svc.Close()
				client, err := svc.Client()
				if err != nil {
					return err
				}
				defer client.Close()
				rows, err := svc.Pool.Query(ctx, `SELECT id FROM users WHERE welcomed_at IS NULL`)
				if err != nil {
					return err
				}
				defer rows.Close()
				for rows.Next() {
					var id string
					if err := rows.Scan(&id); err != nil {
						return err
					}
					// Once per user however often this runs: the key is the user's.
					if _, err := client.Enqueue(ctx, SendWelcome.New(Welcome{UserID: id})); err != nil {
						return err
					}
				}
				return rows.Err()
			},
		}}
	}
	cli.Main(app)
}

// A subcommand that runs a worker of its own making takes the worker's
// flags (--queues, --concurrency, …, with their variables) from
// WorkerFlags and its metrics and death alerts (--metrics-addr,
// --alert-webhook) from Observe, as `worker` does.
func ExampleWorkerFlags() {
	app := welcomeApp()
	app.Commands = func(env *cli.Env) []*cobra.Command {
		w := &cli.WorkerFlags{}
		cmd := &cobra.Command{
			Use:   "welcome-worker",
			Short: "A worker for welcomes only, with its own middleware",
			Args:  cobra.NoArgs,
			RunE: func(cmd *cobra.Command, _ []string) error {
				cfg, err := w.Config()
				if err != nil {
					return err
				}
				ctx := cmd.Context()
				svc, err := env.Open(ctx)
				if err != nil {
					return err
				}
				defer svc.Close()
				cfg.Redis, cfg.Pool, cfg.Logger = svc.Redis, svc.Pool, svc.Log
				mux := tasks.NewMux()
				if err := app.Register(mux, svc); err != nil {
					return err
				}
				ob, err := env.Observe(&cfg, nil)
				if err != nil {
					return err
				}
				srv, err := server.New(cfg, mux)
				if err != nil {
					return cli.UsageError(err)
				}
				ob.Attach(srv)
				// The metrics server and the alerter stop with the worker.
				octx, stop := context.WithCancel(ctx)
				var wg sync.WaitGroup
				defer func() { stop(); wg.Wait() }()
				if err := ob.Run(octx, &wg); err != nil {
					return err
				}
				return srv.Run(ctx)
			},
		}
		w.Bind(cmd)
		return []*cobra.Command{cmd}
	}
	cli.Main(app)
}

// A mistake in the command line is a usage error, which Main reports as
// one line and exit status 2 (any other error exits 1); a program's own
// subcommands mark theirs with UsageError.
func ExampleUsageError() {
	app := welcomeApp()
	app.Commands = func(*cli.Env) []*cobra.Command {
		return []*cobra.Command{{
			Use:  "greet NAME",
			Args: cobra.ExactArgs(1),
			RunE: func(cmd *cobra.Command, args []string) error {
				if args[0] == "" {
					return cli.UsageError(errors.New("greet: NAME must not be empty"))
				}
				fmt.Fprintln(cmd.OutOrStdout(), "hello,", args[0])
				return nil
			},
		}}
	}
	for _, args := range [][]string{{"greet", ""}, {"greet"}, {"greet", "ana"}} {
		root := cli.New(app)
		root.SetArgs(args)
		if err := root.ExecuteContext(context.Background()); err != nil {
			fmt.Println(cli.ErrorLine("welcome", err), "— usage error:", cli.IsUsageError(err))
		}
	}
	// Output:
	// welcome: greet: NAME must not be empty — usage error: true
	// welcome: accepts 1 arg(s), received 0 — usage error: true
	// hello, ana
}
