package main

import (
	"bytes"
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/cli"
)

// The stock binary has every cli subcommand and bench, and no worker of
// its own: it declares no handlers.
func TestStockBinary(t *testing.T) {
	root := cli.New(app())
	have := map[string]bool{}
	for _, c := range root.Commands() {
		have[c.Name()] = true
	}
	for _, name := range []string{"worker", "scheduler", "relay", "migrate", "enqueue", "status", "dead", "ledger", "web", "version", "healthcheck", "bench"} {
		require.True(t, have[name], "keel %s", name)
	}
	require.False(t, have["demo"] || have["api"], "the example's subcommands live in examples/orders")

	root.SetArgs([]string{"worker"})
	root.SetOut(&bytes.Buffer{})
	err := root.ExecuteContext(context.Background())
	require.ErrorContains(t, err, "keel has no handlers to run")
	require.True(t, cli.IsUsageError(err))
}
