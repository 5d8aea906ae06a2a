// Command welcome is the README's "Your own worker binary": one kind, its
// handler, and every keel subcommand for it.
package main

import (
	"context"
	"log/slog"

	"github.com/keeljobs/keel/cli"
	"github.com/keeljobs/keel/tasks"
)

type Welcome struct {
	UserID string `json:"user_id"`
}

var SendWelcome = tasks.Define[Welcome]("user:send_welcome",
	tasks.Queue("default"), tasks.MaxRetry(5),
	tasks.Key(func(w Welcome) string { return "user:" + w.UserID }))

func main() {
	cli.Main(cli.App{
		Name:  "welcome",
		Kinds: tasks.NewKinds(SendWelcome),
		Register: func(mux *tasks.Mux, _ *cli.Service) error {
			tasks.Handle(mux, SendWelcome, func(ctx context.Context, w Welcome) error {
				slog.InfoContext(ctx, "welcome", "user", w.UserID)
				return nil
			})
			return nil
		},
	})
}
