package main

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/internal/testenv"
)

// The workflows guide's example, built and run as a program: each step
// runs once, in the order the workflow draws.
func TestWorkflowExampleRuns(t *testing.T) {
	out := testenv.RunExample(t, "keel_test_example_workflow")
	require.Contains(t, out, "charge: succeeded\npack: succeeded\ninvoice: succeeded\nship: succeeded\n"+
		"charge first: true; ship last: true; 4 runs\n")
}

// The workflows guide (docs/workflows.md) shows this program as it is.
func TestWorkflowsGuideShowsTheProgram(t *testing.T) {
	testenv.GuideShows(t, "../../docs/workflows.md")
}
