package cli

import (
	"os/exec"
	"strings"
	"testing"
)

// TestShellWordRoundTrips: a name quoted for a suggested command is read
// back by the shell as the name, on one line, whatever it holds.
func TestShellWordRoundTrips(t *testing.T) {
	bash, err := exec.LookPath("bash")
	if err != nil {
		t.Skip("no bash")
	}
	for _, s := range []string{"charge", "", "two words", "it's", `back\slash`, "line\nbreak", "tab\there",
		"bell\a", "del\x7f", "$(echo x)", "quote'and\nnewline", "ümlaut ok", `"dq"`, "a\\'b"} {
		w := shellWord(s)
		if strings.ContainsAny(w, "\n\r\t") || strings.ContainsFunc(w, func(r rune) bool { return r < 0x20 || r == 0x7f }) {
			t.Errorf("shellWord(%q) = %q: a control character in the suggested command", s, w)
		}
		out, err := exec.Command(bash, "-c", "printf %s "+w).Output()
		if err != nil {
			t.Fatalf("bash on shellWord(%q) = %q: %v", s, w, err)
		}
		if string(out) != s {
			t.Errorf("shellWord(%q) = %q reads back as %q", s, w, out)
		}
	}
}
