package scheduler_test

import (
	"os"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/handlers" // declares the kinds the example names
	"github.com/keeljobs/keel/scheduler"
)

// The cron guide's schedule example must load as written, and say what the
// shipped examples/schedule.yaml says.
func TestCronGuideExampleLoads(t *testing.T) {
	readme, err := os.ReadFile("../docs/cron.md")
	require.NoError(t, err)
	section := string(readme)
	start := strings.Index(section, "```yaml\n")
	require.GreaterOrEqual(t, start, 0, "docs/cron.md has no yaml block")
	block := section[start+len("```yaml\n"):]
	block = block[:strings.Index(block, "```")]

	fromReadme, err := scheduler.ParseFile("docs/cron.md", []byte(block))
	require.NoError(t, err)
	require.NoError(t, scheduler.ValidateEntries(fromReadme, handlers.Kinds.Known))
	require.Len(t, fromReadme, 2)

	shipped, err := scheduler.LoadFile("../examples/schedule.yaml")
	require.NoError(t, err)
	require.Equal(t, shipped[:2], fromReadme, "docs/cron.md and examples/schedule.yaml disagree")
}
