// Command keel runs keel's worker, relay and operator tools.
package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	if err := newRoot().ExecuteContext(ctx); err != nil {
		msg := err.Error()
		if !strings.HasPrefix(msg, "keel") {
			msg = "keel: " + msg
		}
		fmt.Fprintln(os.Stderr, msg)
		var ue usageError
		if errors.As(err, &ue) {
			os.Exit(2)
		}
		os.Exit(1)
	}
}

type usageError struct{ error }

func (u usageError) Unwrap() error { return u.error }
