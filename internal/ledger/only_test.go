package ledger_test

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// sqlWord tells a statement (maintenance ones too) from a message that
// names a table.
var sqlWord = regexp.MustCompile(`(?i)\b(select|insert|update|delete|from|join|into|truncate|vacuum|analyze)\b`)

// keelObjects matches a mention of one of keel's own tables or functions,
// as the migrations create them (a table added later is covered without
// a word here), not the keel_example_* tables of the example business code.
func keelObjects(t *testing.T, root string) *regexp.Regexp {
	t.Helper()
	create := regexp.MustCompile(`(?i)CREATE\s+(?:OR\s+REPLACE\s+)?(?:UNLOGGED\s+)?(?:TABLE|FUNCTION|VIEW|SEQUENCE)\s+(?:IF\s+NOT\s+EXISTS\s+)?(keel_[a-z_]+)`)
	files, err := filepath.Glob(filepath.Join(root, "migrate", "migrations", "*.sql"))
	if err != nil || len(files) == 0 {
		t.Fatalf("the migrations: %v (%d files)", err, len(files))
	}
	names := map[string]bool{"keel_schema_migrations": true} // migrate's own, created in Go
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range create.FindAllStringSubmatch(string(b), -1) {
			names[m[1]] = true
		}
	}
	for _, must := range []string{"keel_jobs", "keel_outbox", "keel_job_deps", "keel_pauses"} {
		if !names[must] {
			t.Fatalf("the migrations were not read: %s not among %v", must, names)
		}
	}
	return regexp.MustCompile(`\b(` + strings.Join(slices.Sorted(maps.Keys(names)), "|") + `)\b`)
}

// Nothing outside this package (and the migrations, which own the schema,
// and the test helpers) writes SQL against keel's tables: a DBA reads every
// statement here.
func TestStatementsLiveHere(t *testing.T) {
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	keelTable := keelObjects(t, root)
	var found []string
	err = filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, path)
		if d.IsDir() {
			switch rel {
			case "internal/ledger", "migrate", ".git", "bench/river", "internal/testenv", "internal/testworker":
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return nil
		}
		f, err := parser.ParseFile(token.NewFileSet(), path, nil, parser.SkipObjectResolution)
		if err != nil {
			return err
		}
		ast.Inspect(f, func(n ast.Node) bool {
			if lit, ok := n.(*ast.BasicLit); ok && lit.Kind == token.STRING && keelTable.MatchString(lit.Value) && sqlWord.MatchString(lit.Value) {
				found = append(found, rel)
				return false
			}
			return true
		})
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	for _, f := range found {
		if seen[f] {
			continue
		}
		seen[f] = true
		t.Errorf("%s writes SQL on keel's tables: its statements belong in internal/ledger", f)
	}
}
