package docs_test

import (
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"
)

var (
	// release is a version's heading in CHANGELOG.md (Keep a Changelog).
	release = regexp.MustCompile(`^## \[(\d+)\.(\d+)\.(\d+)\] - (\d{4}-\d{2}-\d{2})$`)
	goGet   = regexp.MustCompile("`go get github\\.com/keeljobs/keel@([^`]+)`")
)

// The README (and the changelog's opening) say to depend on the newest
// release CHANGELOG.md lists, and
// the changelog's releases are in order, newest first, each with a date and
// a link to its tag.
func TestTheReadmeNamesTheNewestRelease(t *testing.T) {
	root := filepath.Join("..", "..")
	log, err := os.ReadFile(filepath.Join(root, "CHANGELOG.md"))
	if err != nil {
		t.Fatal(err)
	}
	var versions []string
	var last [3]int
	var lastDate time.Time
	unreleased := false
	outsideCode(string(log), func(l string) {
		if l == "## [Unreleased]" {
			if len(versions) > 0 {
				t.Errorf("CHANGELOG.md: [Unreleased] comes after a release")
			}
			unreleased = true
			return
		}
		m := release.FindStringSubmatch(l)
		if m == nil {
			if strings.HasPrefix(l, "## [") {
				t.Errorf("CHANGELOG.md: %q is neither [Unreleased] nor [X.Y.Z] - YYYY-MM-DD", l)
			}
			return
		}
		var v [3]int
		for i := range v {
			v[i], _ = strconv.Atoi(m[i+1])
		}
		date, err := time.Parse(time.DateOnly, m[4])
		if err != nil {
			t.Errorf("CHANGELOG.md: %q: %v", l, err)
		}
		if len(versions) > 0 && (!older(v, last) || date.After(lastDate)) {
			t.Errorf("CHANGELOG.md: %q is not older than the release above it", l)
		}
		last, lastDate = v, date
		ver := strings.Join(m[1:4], ".")
		versions = append(versions, ver)
		if !strings.Contains(string(log), "\n["+ver+"]: https://github.com/keeljobs/keel/releases/tag/v"+ver+"\n") {
			t.Errorf("CHANGELOG.md: no link [%s]: …/releases/tag/v%s at its end", ver, ver)
		}
	})
	if !unreleased {
		t.Error("CHANGELOG.md has no [Unreleased] section for what is not released yet")
	}
	if len(versions) == 0 {
		t.Fatal("CHANGELOG.md lists no release")
	}
	for _, name := range []string{"README.md", "CHANGELOG.md"} {
		b, err := os.ReadFile(filepath.Join(root, name))
		if err != nil {
			t.Fatal(err)
		}
		m := goGet.FindSubmatch(b)
		if m == nil {
			t.Fatalf("%s does not say how to depend on keel (`go get github.com/keeljobs/keel@vX.Y.Z`)", name)
		}
		if got, want := string(m[1]), "v"+versions[0]; got != want {
			t.Errorf("%s says go get …@%s; the newest release is %s", name, got, want)
		}
	}
}

// older says whether a comes before b in semantic-version order.
func older(a, b [3]int) bool {
	for i := range a {
		if a[i] != b[i] {
			return a[i] < b[i]
		}
	}
	return false
}
