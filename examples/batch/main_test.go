package main

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/internal/testenv"
)

// The README's batch example, built and run as a program: its callback
// reports every invoice sent.
func TestBatchExampleRuns(t *testing.T) {
	out := testenv.RunExample(t, "keel_test_example_batch")
	require.Contains(t, out, "3 invoices: 3 sent, 0 dead (completion 1)\n")
}

// The batches guide (docs/batches.md) shows this program as it is.
func TestBatchesGuideShowsTheBatchProgram(t *testing.T) {
	testenv.GuideShows(t, "../../docs/batches.md")
}
