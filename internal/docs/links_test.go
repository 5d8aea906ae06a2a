package docs_test

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

var (
	heading = regexp.MustCompile(`^#{1,6} (.+)$`)
	link    = regexp.MustCompile(`\]\(([^)\s]+)\)`)
	notWord = regexp.MustCompile(`[^\p{L}\p{N}_\- ]`)
)

// anchor is the fragment the forge gives a heading.
func anchor(h string) string {
	return strings.ReplaceAll(notWord.ReplaceAllString(strings.ToLower(strings.TrimSpace(h)), ""), " ", "-")
}

// outsideCode calls fn with each line of a Markdown file not in a fenced block.
func outsideCode(text string, fn func(line string)) {
	inCode := false
	for _, l := range strings.Split(text, "\n") {
		if strings.HasPrefix(l, "```") {
			inCode = !inCode
			continue
		}
		if !inCode {
			fn(l)
		}
	}
}

func TestRelativeLinksLeadSomewhere(t *testing.T) {
	root := filepath.Join("..", "..")
	guides, err := filepath.Glob(filepath.Join(root, "docs", "*.md"))
	if err != nil {
		t.Fatal(err)
	}
	files := append([]string{filepath.Join(root, "README.md"), filepath.Join(root, "BENCHMARKS.md"),
		filepath.Join(root, "CHANGELOG.md")}, guides...)
	if len(guides) == 0 {
		t.Fatal("no guides in docs/")
	}
	anchors := map[string]map[string]bool{}
	texts := map[string]string{}
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		texts[f] = string(b)
		anchors[f] = map[string]bool{}
		outsideCode(string(b), func(l string) {
			if m := heading.FindStringSubmatch(l); m != nil {
				anchors[f][anchor(m[1])] = true
			}
		})
	}
	for _, f := range files {
		outsideCode(texts[f], func(l string) {
			for _, m := range link.FindAllStringSubmatch(l, -1) {
				target := m[1]
				if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
					continue
				}
				path, frag, _ := strings.Cut(target, "#")
				dest := f
				if path != "" {
					dest = filepath.Join(filepath.Dir(f), path)
					if _, err := os.Stat(dest); err != nil {
						t.Errorf("%s: %s leads to no file", f, target)
						continue
					}
				}
				if frag != "" && anchors[dest] != nil && !anchors[dest][frag] {
					t.Errorf("%s: %s: %s has no such heading", f, target, dest)
				}
			}
		})
	}
}
