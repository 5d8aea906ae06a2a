package main

import (
	"context"
	"errors"
	"net/http"
	"os"
	"time"

	"github.com/spf13/cobra"

	"github.com/keeljobs/keel/cli"
	"github.com/keeljobs/keel/handlers"
)

func apiCmd(env *cli.Env) *cobra.Command {
	var addr string
	cmd := &cobra.Command{
		Use:   "api",
		Short: "Serve the example order API (POST /orders, GET /orders/{id}), enqueueing through the ledger",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx := cmd.Context()
			svc, err := env.Open(ctx)
			if err != nil {
				return err
			}
			defer svc.Close()
			pool, log := svc.Pool, svc.Log
			client, err := svc.Client()
			if err != nil {
				return err
			}
			defer client.Close()
			srv := &http.Server{Addr: addr, Handler: (&handlers.API{Pool: pool, Client: client}).Handler(),
				ReadHeaderTimeout: 5 * time.Second}
			go func() {
				<-ctx.Done()
				sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				defer cancel()
				_ = srv.Shutdown(sctx)
			}()
			log.Info("keel example order API listening", "addr", addr)
			if err := srv.ListenAndServe(); err != nil && !errors.Is(err, http.ErrServerClosed) {
				return err
			}
			return nil
		},
	}
	def := os.Getenv("KEEL_API_ADDR")
	if def == "" {
		def = "127.0.0.1:8081"
	}
	cmd.Flags().StringVar(&addr, "addr", def, "listen address (env KEEL_API_ADDR)")
	return cmd
}
