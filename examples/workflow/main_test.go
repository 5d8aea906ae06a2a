package main

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/internal/testenv"
)

// The workflows guide's example, built and run as a program: each step
// runs once, in the order the workflow draws.
func TestWorkflowExampleRuns(t *testing.T) {
	redis := testenv.StartRedis(t)
	const schema = "keel_test_example_workflow"
	testenv.Pool(t, schema) // a fresh schema; the program migrates it again
	bin := filepath.Join(t.TempDir(), "workflow")
	out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput()
	require.NoError(t, err, "%s", out)

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin)
	cmd.Env = []string{"DATABASE_URL=" + testenv.URL(schema), "REDIS_ADDR=" + redis.Addr()}
	out, err = cmd.CombinedOutput()
	require.NoError(t, err, "%s", out)
	require.Contains(t, string(out), "charge: succeeded\npack: succeeded\ninvoice: succeeded\nship: succeeded\n"+
		"charge first: true; ship last: true; 4 runs\n")
}

// The workflows guide (docs/workflows.md) shows this program as it is.
func TestWorkflowsGuideShowsTheProgram(t *testing.T) {
	guide, err := os.ReadFile("../../docs/workflows.md")
	require.NoError(t, err)
	program, err := os.ReadFile("main.go")
	require.NoError(t, err)
	require.Contains(t, string(guide), "```go\n"+string(program)+"```\n")
}
