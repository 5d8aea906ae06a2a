// Command keel runs keel's worker, relay and operator tools.
package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	if err := newRoot().ExecuteContext(ctx); err != nil {
		var ue usageError
		if errors.As(err, &ue) {
			fmt.Fprintln(os.Stderr, "keel:", err)
			os.Exit(2)
		}
		fmt.Fprintln(os.Stderr, "keel:", err)
		os.Exit(1)
	}
}

type usageError struct{ error }
