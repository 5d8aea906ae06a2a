package cli

import (
	"fmt"
	"io"
	"os"
	"strings"

	"golang.org/x/term"
)

// IsTerminal reports whether w is a terminal: progress bars and prompts
// are drawn only there, never into a file or a pipe.
func IsTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	return ok && term.IsTerminal(int(f.Fd()))
}

// progress is a one-line bar redrawn in place on a terminal. On anything
// else it is nil and its methods do nothing.
type progress struct {
	w     io.Writer
	label string
	total int
}

func newProgress(w io.Writer, label string, total int) *progress {
	if !IsTerminal(w) {
		return nil
	}
	return &progress{w: w, label: label, total: total}
}

func (p *progress) set(done int) {
	if p == nil {
		return
	}
	const width = 30
	filled := width * done / max(p.total, 1)
	fmt.Fprintf(p.w, "\r\x1b[K%s [%s%s] %d/%d", p.label, strings.Repeat("█", filled), strings.Repeat("░", width-filled), done, p.total)
}

// done ends the bar's line.
func (p *progress) done() {
	if p != nil {
		fmt.Fprintln(p.w)
	}
}

// clear removes an unfinished bar, so that an error starts on a clean line.
func (p *progress) clear() {
	if p != nil {
		fmt.Fprint(p.w, "\r\x1b[K")
	}
}
