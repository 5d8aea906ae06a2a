package main

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/keeljobs/keel/cli"
)

// The configuration guide is where an operator looks up a setting, so it
// must hold every one and no other. The test lives here because only the
// stock binary's tree has every subcommand, bench included.

const (
	guidePath = "../../docs/configuration.md"
	// everySubcommand is the guide's section of the root's flags.
	everySubcommand = "Every subcommand"
	// examplesSection names the example programs' settings, which are not
	// keel's subcommands.
	examplesSection = "The examples"
)

// exemptVariables are read by keel's code but set by no operator.
var exemptVariables = map[string]string{
	"KEEL_CHILD_DATABASE_URL": "internal/testworker: the tests that start a child worker tell it its ledger",
	"KEEL_BENCH_WORKER":       "internal/bench: keel bench tells the child worker it starts what to run",
}

// exemptPrefixes are families of variables the same is true of.
var exemptPrefixes = map[string]string{
	"KEEL_TEST_": "the test suites' Redis and Postgres (keeltest's too), documented with the tests",
}

var (
	flagName  = regexp.MustCompile(`(?:^|[^\w-])--([a-z][a-z0-9-]*)`)
	codeSpan  = regexp.MustCompile("`([^`]+)`")
	envName   = regexp.MustCompile(`^[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+$`)
	keelInCmd = regexp.MustCompile(`^keel( [a-z-]+)*$`)
)

// section is a heading of the guide and the text below it, up to the next
// heading.
type section struct {
	heading string
	// commands are the command paths the heading names ("keel dead");
	// a command covers its subcommands.
	commands []string
	text     string
}

func guideSections(t *testing.T) []section {
	b, err := os.ReadFile(guidePath)
	if err != nil {
		t.Fatal(err)
	}
	var secs []section
	cur := &section{}
	inCode := false
	for _, l := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(l, "```") {
			inCode = !inCode
		}
		if !inCode && strings.HasPrefix(l, "#") {
			secs = append(secs, *cur)
			h := strings.TrimSpace(strings.TrimLeft(l, "#"))
			cur = &section{heading: h}
			if h == everySubcommand {
				cur.commands = []string{"keel"}
			}
			for _, m := range codeSpan.FindAllStringSubmatch(h, -1) {
				if keelInCmd.MatchString(m[1]) {
					cur.commands = append(cur.commands, m[1])
				}
			}
			continue
		}
		cur.text += l + "\n"
	}
	return append(secs, *cur)
}

// commandFlags maps each command path of the stock binary to the flags it
// takes: its own and those it inherits.
func commandFlags() map[string][]string {
	flags := map[string][]string{}
	var walk func(c *cobra.Command)
	walk = func(c *cobra.Command) {
		path := c.CommandPath()
		add := func(f *pflag.Flag) {
			if f.Name != "help" && !slices.Contains(flags[path], f.Name) {
				flags[path] = append(flags[path], f.Name)
			}
		}
		c.LocalFlags().VisitAll(add)
		c.InheritedFlags().VisitAll(add)
		for _, sub := range c.Commands() {
			walk(sub)
		}
	}
	walk(cli.New(app()))
	return flags
}

// localFlags is commandFlags without the inherited ones: what a command's
// own section must name.
func localFlags() map[string][]string {
	flags := map[string][]string{}
	var walk func(c *cobra.Command)
	walk = func(c *cobra.Command) {
		c.LocalNonPersistentFlags().VisitAll(func(f *pflag.Flag) {
			if f.Name != "help" {
				flags[c.CommandPath()] = append(flags[c.CommandPath()], f.Name)
			}
		})
		if !c.HasParent() {
			c.PersistentFlags().VisitAll(func(f *pflag.Flag) {
				flags[c.CommandPath()] = append(flags[c.CommandPath()], f.Name)
			})
		}
		for _, sub := range c.Commands() {
			walk(sub)
		}
	}
	walk(cli.New(app()))
	return flags
}

func covers(section, command string) bool {
	return command == section || strings.HasPrefix(command, section+" ")
}

func TestConfigurationGuideNamesEveryFlag(t *testing.T) {
	secs := guideSections(t)
	for cmd, flags := range localFlags() {
		for _, f := range flags {
			named := false
			for _, s := range secs {
				for _, c := range s.commands {
					// The root's flags belong to its section alone.
					if (c == "keel" && cmd == "keel" || c != "keel" && covers(c, cmd)) &&
						slices.Contains(flagsIn(s.text), f) {
						named = true
					}
				}
			}
			if !named {
				t.Errorf("%s --%s: docs/configuration.md does not name it in the section of %s", cmd, f, cmd)
			}
		}
	}
}

func TestConfigurationGuideNamesOnlyFlagsThatExist(t *testing.T) {
	all := commandFlags()
	for _, s := range guideSections(t) {
		if s.heading == examplesSection {
			continue
		}
		for _, f := range flagsIn(s.text) {
			found := f == "help" // cobra gives every command one
			for cmd, flags := range all {
				inSection := len(s.commands) == 0
				for _, c := range s.commands {
					inSection = inSection || covers(c, cmd)
				}
				if inSection && slices.Contains(flags, f) {
					found = true
				}
			}
			if !found {
				where := "any command"
				if len(s.commands) > 0 {
					where = strings.Join(s.commands, ", ")
				}
				t.Errorf("docs/configuration.md, %q: --%s is not a flag of %s", s.heading, f, where)
			}
		}
	}
}

func TestConfigurationGuideNamesEveryVariable(t *testing.T) {
	read := variablesRead(t)
	named := map[string]bool{}
	for _, s := range guideSections(t) {
		for _, m := range codeSpan.FindAllStringSubmatch(s.heading+"\n"+s.text, -1) {
			for _, w := range strings.FieldsFunc(m[1], func(r rune) bool { return r == ' ' || r == ',' || r == '=' }) {
				if envName.MatchString(w) {
					named[w] = true
				}
			}
		}
	}
	for v, where := range read {
		if !named[v] && !exempt(v) {
			t.Errorf("%s (read in %s): docs/configuration.md does not name it", v, where)
		}
	}
	for v := range named {
		if _, ok := read[v]; !ok {
			t.Errorf("docs/configuration.md names %s, which no code reads", v)
		}
	}
}

func exempt(v string) bool {
	if exemptVariables[v] != "" {
		return true
	}
	for p := range exemptPrefixes {
		if strings.HasPrefix(v, p) {
			return true
		}
	}
	return false
}

func flagsIn(text string) []string {
	var flags []string
	for _, m := range flagName.FindAllStringSubmatch(text, -1) {
		if !slices.Contains(flags, m[1]) {
			flags = append(flags, m[1])
		}
	}
	return flags
}

// variablesRead finds the environment variables keel's code reads: the
// names given to os.Getenv and os.LookupEnv and to the helpers around them
// (envOr, envBool, splitEnv, …), as literals or string constants. It maps
// each to a file that reads it.
func variablesRead(t *testing.T) map[string]string {
	root := filepath.Join("..", "..")
	type call struct {
		args []ast.Expr
		file string
	}
	var calls []call
	consts := map[string]string{}
	fset := token.NewFileSet()
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, path)
		if d.IsDir() {
			switch {
			case strings.HasPrefix(d.Name(), ".") && rel != ".", d.Name() == "testdata",
				rel == filepath.Join("internal", "testenv"):
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return nil
		}
		f, err := parser.ParseFile(fset, path, nil, parser.SkipObjectResolution)
		if err != nil {
			return err
		}
		ast.Inspect(f, func(n ast.Node) bool {
			switch n := n.(type) {
			case *ast.ValueSpec:
				for i, name := range n.Names {
					if i < len(n.Values) {
						if lit, ok := n.Values[i].(*ast.BasicLit); ok && lit.Kind == token.STRING {
							consts[name.Name], _ = strconv.Unquote(lit.Value)
						}
					}
				}
			case *ast.CallExpr:
				var name string
				switch fn := n.Fun.(type) {
				case *ast.Ident:
					name = fn.Name
				case *ast.SelectorExpr:
					name = fn.Sel.Name
				}
				if name == "Getenv" || name == "LookupEnv" || strings.HasPrefix(name, "env") || strings.HasSuffix(name, "Env") {
					calls = append(calls, call{n.Args, rel})
				}
			}
			return true
		})
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	read := map[string]string{}
	for _, c := range calls {
		for _, a := range c.args {
			var v string
			switch a := a.(type) {
			case *ast.BasicLit:
				if a.Kind == token.STRING {
					v, _ = strconv.Unquote(a.Value)
				}
			case *ast.Ident:
				v = consts[a.Name]
			case *ast.SelectorExpr:
				v = consts[a.Sel.Name]
			}
			if envName.MatchString(v) {
				read[v] = c.file
			}
		}
	}
	// The scan sees through each way the code reads a variable.
	for _, v := range []string{"REDIS_URL", "KEEL_QUEUES", "KEEL_STRICT_PRIORITY", "KEEL_RATE_LIMITS", "KEEL_WEB_USERS", "KEEL_BENCH_WORKER"} {
		if read[v] == "" {
			t.Fatalf("the scan of the code misses %s", v)
		}
	}
	return read
}
