package migrate_test

import (
	"fmt"
	"os"
	"strings"
	"testing"

	"github.com/keeljobs/keel/migrate"
)

// CHANGELOG.md lists every migration the binary embeds, with whether it is
// additive as its marker says.
func TestChangelogListsEveryMigration(t *testing.T) {
	b, err := os.ReadFile("../CHANGELOG.md")
	if err != nil {
		t.Fatal(err)
	}
	ms, err := migrate.All()
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range ms {
		var row string
		for _, line := range strings.Split(string(b), "\n") {
			if strings.HasPrefix(line, fmt.Sprintf("| %04d |", m.Version)) {
				row = line
			}
		}
		if row == "" {
			t.Errorf("CHANGELOG.md has no row for migration %04d (%s)", m.Version, m.Name)
			continue
		}
		if additive := strings.HasSuffix(row, "| yes |"); additive != m.Additive {
			t.Errorf("CHANGELOG.md says migration %04d additive: %v; its file: %v", m.Version, additive, m.Additive)
		}
	}
}
