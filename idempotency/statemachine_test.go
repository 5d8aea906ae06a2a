package idempotency_test

import (
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/keeljobs/keel/internal/ledger"
)

// docs/state_machine.md draws every status, ends exactly the terminal ones,
// and has a row for each.
func TestStateMachineDocumentsEveryStatus(t *testing.T) {
	b, err := os.ReadFile("../docs/state_machine.md")
	if err != nil {
		t.Fatal(err)
	}
	doc := string(b)
	diagram := regexp.MustCompile("(?s)```mermaid\n(.*?)```").FindStringSubmatch(doc)
	if diagram == nil {
		t.Fatal("no mermaid diagram")
	}
	for _, st := range ledger.Statuses() {
		s := string(st)
		if !regexp.MustCompile(`(?m)^\s*(` + s + ` --> |\S+ --> ` + s + `:)`).MatchString(diagram[1]) {
			t.Errorf("the diagram has no move of %s", s)
		}
		ends := strings.Contains(diagram[1], s+" --> [*]")
		if ends != st.Terminal() {
			t.Errorf("%s: ends in the diagram %v, Terminal() %v", s, ends, st.Terminal())
		}
		if !strings.Contains(doc, "| `"+s+"` |") {
			t.Errorf("no table row for %s", s)
		}
	}
}
