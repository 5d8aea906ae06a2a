package ledger_test

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// keelTable matches a mention of one of keel's own tables (or functions),
// not the keel_example_* tables of the example business code; sqlWord
// tells a statement (maintenance ones too) from a message that names a
// table.
var (
	keelTable = regexp.MustCompile(`\bkeel_(jobs|steps|batches|batch_seal|outbox|audit|prune_log|schedule|schedule_entries|schedule_pauses|schema_migrations|web_sessions_ended|job_progress|job_results)\b`)
	sqlWord   = regexp.MustCompile(`(?i)\b(select|insert|update|delete|from|join|into|truncate|vacuum|analyze)\b`)
)

// Nothing outside this package (and the migrations, which own the schema,
// and the test helpers) writes SQL against keel's tables: a DBA reads every
// statement here.
func TestStatementsLiveHere(t *testing.T) {
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
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
