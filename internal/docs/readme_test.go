package docs_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// maxReadmeLines keeps the README a first hour's read: what keel is, the
// two commands, the tour, the smallest program and a map. Detail belongs in
// the guide in docs/ that the README links to.
const maxReadmeLines = 350

func TestReadmeStaysShort(t *testing.T) {
	b, err := os.ReadFile(filepath.Join("..", "..", "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(string(b), "\n"); n > maxReadmeLines {
		t.Errorf("README.md has %d lines, more than %d: move detail to the guide in docs/ it belongs in, and link to it", n, maxReadmeLines)
	}
}
