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

// The README's batch example, built and run as a program: its callback
// reports every invoice sent.
func TestBatchExampleRuns(t *testing.T) {
	redis := testenv.StartRedis(t)
	const schema = "keel_test_example_batch"
	testenv.Pool(t, schema) // a fresh schema; the program migrates it again
	bin := filepath.Join(t.TempDir(), "batch")
	out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput()
	require.NoError(t, err, "%s", out)

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin)
	cmd.Env = []string{"DATABASE_URL=" + testenv.URL(schema), "REDIS_ADDR=" + redis.Addr()}
	out, err = cmd.CombinedOutput()
	require.NoError(t, err, "%s", out)
	require.Contains(t, string(out), "3 invoices: 3 sent, 0 dead (completion 1)\n")
}

// The batches guide (docs/batches.md) shows this program as it is.
func TestBatchesGuideShowsTheBatchProgram(t *testing.T) {
	readme, err := os.ReadFile("../../docs/batches.md")
	require.NoError(t, err)
	program, err := os.ReadFile("main.go")
	require.NoError(t, err)
	section := string(readme)
	require.Contains(t, section, "```go\n"+string(program)+"```\n")
}
