package testenv

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// RunExample builds the example program in the test's directory and runs
// it, as a reader of its guide would, against a fresh ledger schema and a
// private Redis (DATABASE_URL, REDIS_ADDR); it returns what it printed and
// fails the test if it does not build or exits with an error.
func RunExample(t *testing.T, schema string) string {
	t.Helper()
	redis := StartRedis(t)
	Pool(t, schema) // a fresh schema; the program migrates it again
	bin := filepath.Join(t.TempDir(), "example")
	if out, err := GoBuild("-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("build the example: %v\n%s", err, out)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin)
	cmd.Env = []string{"DATABASE_URL=" + URL(schema), "REDIS_ADDR=" + redis.Addr(), NoRaceExitSleep}
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("run the example: %v\n%s", err, out)
	}
	return string(out)
}

// GuideShows fails the test unless the guide (a path) shows the program
// in the test's main.go as it is, in a Go code block.
func GuideShows(t *testing.T, guide string) {
	t.Helper()
	doc, err := os.ReadFile(guide)
	if err != nil {
		t.Fatal(err)
	}
	program, err := os.ReadFile("main.go")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(doc), "```go\n"+string(program)+"```\n") {
		t.Errorf("%s does not show main.go as it is", guide)
	}
}

// GoBuild is `go build` with the test binary's own race setting: a program
// a test builds then links the packages the tests compiled, where a build
// without -race would compile every dependency a second time (two of the
// minutes a fresh machine's CI spends).
func GoBuild(args ...string) *exec.Cmd {
	if Race {
		args = append([]string{"-race"}, args...)
	}
	return exec.Command("go", append([]string{"build"}, args...)...)
}

// NoRaceExitSleep, in a race-built program's environment, spares it the
// race detector's second of sleep at exit (its atexit_sleep_ms), which a
// test that waits for the program to end would wait out every time.
const NoRaceExitSleep = "GORACE=atexit_sleep_ms=0"
