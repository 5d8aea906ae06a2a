// Command keel is keel's stock binary: the operator's tools (migrate,
// enqueue, status, dead, ledger, web, scheduler, relay, healthcheck) for
// jobs whatever program handles them, and `keel bench`. It declares no
// kinds and runs no handlers: a worker is your own binary, built with the
// cli package the same way as this one (see examples/orders).
package main

import (
	"github.com/spf13/cobra"

	"github.com/keeljobs/keel/cli"
)

func app() cli.App {
	return cli.App{
		Name: "keel",
		Commands: func(env *cli.Env) []*cobra.Command {
			return []*cobra.Command{benchCmd(env)}
		},
	}
}

func main() { cli.Main(app()) }
