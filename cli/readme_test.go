package cli_test

import (
	"os"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// The README's "Your own worker binary" shows examples/welcome/main.go, the
// program TestYourOwnBinary builds and runs, as it is.
func TestReadmeShowsTheWelcomeProgram(t *testing.T) {
	readme, err := os.ReadFile("../README.md")
	require.NoError(t, err)
	program, err := os.ReadFile("../examples/welcome/main.go")
	require.NoError(t, err)
	_, section, ok := strings.Cut(string(readme), "\n## Your own worker binary\n")
	require.True(t, ok, "the README has no section \"Your own worker binary\"")
	section, _, _ = strings.Cut(section, "\n## ")
	require.Contains(t, section, "```go\n"+string(program)+"```\n")
	require.LessOrEqual(t, strings.Count(string(program), "\n"), 35, "the program stays short")
}

// The failures guide says what a bulk dead-letter action asks, in its words
// (TestResolveAStepInDoubtFromTheCommandLine sees the CLI ask it), and how to skip it.
func TestFailuresGuideSaysHowABulkActionIsConfirmed(t *testing.T) {
	readme, err := os.ReadFile("../docs/failures.md")
	require.NoError(t, err)
	_, section, ok := strings.Cut(string(readme), "\n## Failures and dead letters\n")
	require.True(t, ok, "docs/failures.md has no section \"Failures and dead letters\"")
	section, _, _ = strings.Cut(section, "\n## ")
	section = strings.Join(strings.Fields(section), " ")
	require.Contains(t, section, "`type 49 to discard them:`")
	require.Contains(t, section, "`--yes` skips the question")
}
