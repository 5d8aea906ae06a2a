package publicapi

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// reviewedAliases are the internal types public packages alias, each read
// for what its fields and methods hand users (server.GuardConfig is
// executor.GuardConfig; a Guard alias would hand them the guard's Close).
var reviewedAliases = map[string]bool{
	"internal/cronspec.Entry": true, "internal/executor.CancelEvent": true, "internal/executor.GuardConfig": true,
	"internal/executor.GuardStats": true, "internal/executor.StepOption": true, "internal/jobstore.Batch": true,
	"internal/jobstore.DeadEvent": true, "internal/ledger.Action": true, "internal/ledger.AuditEntry": true,
	"internal/ledger.Job": true, "internal/ledger.JobProgress": true, "internal/ledger.JobResult": true,
	"internal/ledger.KeyCount": true, "internal/ledger.KindHeld": true, "internal/ledger.KindPause": true,
	"internal/ledger.ParentResult": true, "internal/ledger.Pause": true, "internal/ledger.Policy": true,
	"internal/ledger.Related": true, "internal/ledger.SchedulePause": true, "internal/ledger.Status": true,
	"internal/ledger.StepRecord": true, "internal/ledger.WaitingCount": true, "internal/ledger.WorkflowNode": true,
}

// use is a mention of an internal package's identifier in a public
// declaration.
type use struct{ where, what string }

// TestPublicAPINamesNoInternalType: an exported function, method, field,
// variable or type of a public package mentions an internal package's type
// only if a public package aliases it (server.GuardConfig is
// executor.GuardConfig), and every such alias was reviewed. Otherwise a
// user is handed a value whose type no documentation names, with every
// method it has, those keel uses inside (stopping a worker's guard, say)
// too. Read from the syntax alone: an untyped variable set by a call is
// not seen.
func TestPublicAPINamesNoInternalType(t *testing.T) {
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	aliased := map[string]bool{}
	var uses []use
	files := 0
	err = filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, path)
		if d.IsDir() {
			switch {
			case rel == ".":
				return nil
			case d.Name() == "internal" || d.Name() == "testdata" || strings.HasPrefix(d.Name(), "."),
				rel == "cmd" || rel == "examples" || rel == "chaos" || rel == "bench":
				return filepath.SkipDir // not importable, or no one's API
			}
			return nil
		}
		if !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return nil
		}
		fset := token.NewFileSet()
		f, err := parser.ParseFile(fset, path, nil, parser.SkipObjectResolution)
		if err != nil {
			return err
		}
		if f.Name.Name == "main" {
			return nil
		}
		files++
		a, u := publicMentions(fset, f, rel)
		for k := range a {
			aliased[k] = true
		}
		uses = append(uses, u...)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if files < 50 || len(aliased) == 0 {
		t.Fatalf("read %d files and %d aliases: the walk missed the public packages", files, len(aliased))
	}
	const module = "github.com/keeljobs/keel/"
	for a := range aliased {
		if !reviewedAliases[strings.TrimPrefix(a, module)] {
			t.Errorf("a public package aliases %s: an alias hands users every field and method of the type; "+
				"review them, then add it to reviewedAliases", a)
		}
	}
	for _, u := range uses {
		if !aliased[u.what] {
			t.Errorf("%s: %s, which no public package names (alias it, or keep it out of the API)", u.where, u.what)
		}
	}
}

// publicMentions returns the internal types f aliases publicly, and the
// internal identifiers its exported declarations mention otherwise.
func publicMentions(fset *token.FileSet, f *ast.File, rel string) (aliased map[string]bool, uses []use) {
	internal := map[string]string{} // local name → import path
	for _, im := range f.Imports {
		path, _ := strconv.Unquote(im.Path.Value)
		if !strings.Contains(path, "/internal/") {
			continue
		}
		name := path[strings.LastIndex(path, "/")+1:]
		if im.Name != nil {
			name = im.Name.Name
		}
		internal[name] = path
	}
	aliased = map[string]bool{}
	if len(internal) == 0 {
		return aliased, nil
	}
	qualified := func(e ast.Expr) (string, bool) {
		se, ok := e.(*ast.SelectorExpr)
		if !ok {
			return "", false
		}
		id, ok := se.X.(*ast.Ident)
		if !ok || internal[id.Name] == "" {
			return "", false
		}
		return internal[id.Name] + "." + se.Sel.Name, true
	}
	check := func(pos token.Pos, name string, n ast.Node) {
		ast.Inspect(n, func(n ast.Node) bool {
			if e, ok := n.(ast.Expr); ok {
				if what, ok := qualified(e); ok {
					p := fset.Position(pos)
					uses = append(uses, use{where: rel + ":" + strconv.Itoa(p.Line) + " " + name, what: what})
					return false
				}
			}
			return true
		})
	}
	for _, d := range f.Decls {
		switch d := d.(type) {
		case *ast.FuncDecl:
			if !d.Name.IsExported() || (d.Recv != nil && !exportedReceiver(d.Recv.List[0].Type)) {
				continue
			}
			check(d.Pos(), d.Name.Name, d.Type)
		case *ast.GenDecl:
			for _, sp := range d.Specs {
				switch sp := sp.(type) {
				case *ast.TypeSpec:
					if !sp.Name.IsExported() {
						continue
					}
					if sp.Assign != 0 {
						if what, ok := qualified(sp.Type); ok {
							aliased[what] = true
							continue
						}
					}
					st, ok := sp.Type.(*ast.StructType)
					if !ok {
						check(sp.Pos(), sp.Name.Name, sp.Type)
						continue
					}
					for _, fl := range st.Fields.List {
						exported := len(fl.Names) == 0 // embedded: its methods are promoted
						for _, n := range fl.Names {
							exported = exported || n.IsExported()
						}
						if exported {
							check(fl.Pos(), sp.Name.Name+" field", fl.Type)
						}
					}
				case *ast.ValueSpec:
					for i, n := range sp.Names {
						switch {
						case !n.IsExported():
						case sp.Type != nil:
							check(sp.Pos(), n.Name, sp.Type)
						case i < len(sp.Values):
							// Untyped: a composite literal of an internal
							// type shows it (a call's result type does
							// not, without type-checking).
							ast.Inspect(sp.Values[i], func(x ast.Node) bool {
								if cl, ok := x.(*ast.CompositeLit); ok && cl.Type != nil {
									check(sp.Pos(), n.Name, cl.Type)
								}
								return true
							})
						}
					}
				}
			}
		}
	}
	return aliased, uses
}

func exportedReceiver(e ast.Expr) bool {
	if s, ok := e.(*ast.StarExpr); ok {
		e = s.X
	}
	if g, ok := e.(*ast.IndexExpr); ok {
		e = g.X
	}
	if g, ok := e.(*ast.IndexListExpr); ok {
		e = g.X
	}
	id, ok := e.(*ast.Ident)
	return ok && id.IsExported()
}
