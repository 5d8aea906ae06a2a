// Command orders is keel's example order service built as a team would
// build its own binary: it declares its kinds and handlers and gets every
// keel subcommand for them from the cli package, plus two of its own: `api`
// (the order API) and `demo` (the whole stack in one process, with traffic).
//
//	go run ./examples/orders demo
package main

import (
	"github.com/spf13/cobra"

	"github.com/keeljobs/keel/cli"
	"github.com/keeljobs/keel/handlers"
	"github.com/keeljobs/keel/tasks"
)

func app() cli.App {
	return cli.App{
		Name:  "orders",
		Short: "keel's example order service: its worker, API, demo and every keel subcommand for its kinds",
		Kinds: handlers.Kinds,
		Register: func(mux *tasks.Mux, svc *cli.Service) error {
			handlers.Register(mux, handlers.Deps{Pool: svc.Pool, Mailer: handlers.LogMailer{Log: svc.Log}})
			return nil
		},
		Migrate: handlers.Migrate,
		Commands: func(env *cli.Env) []*cobra.Command {
			return []*cobra.Command{apiCmd(env), demoCmd(env)}
		},
	}
}

func main() { cli.Main(app()) }
