// Package visible shows text from jobs (errors, keys, notes) to people
// without letting it act on their screen: characters that would hide or
// rearrange text, or drive a terminal, become visible codes.
package visible

import (
	"fmt"
	"io"
	"strings"
	"unicode"
	"unicode/utf8"
)

// Text returns s with every Hidden character written as [U+XXXX]:
// bidirectional overrides and isolates (a key with U+202E would reverse the
// rest of the line), zero-width and other invisible characters, invalid
// UTF-8 and control characters other than tab and newline (an ESC starts a
// terminal's escape sequence).
func Text(s string) string {
	if !strings.ContainsFunc(s, Hidden) {
		return s
	}
	var b strings.Builder
	for _, r := range s {
		if Hidden(r) {
			fmt.Fprintf(&b, "[U+%04X]", r)
			continue
		}
		b.WriteRune(r)
	}
	return b.String()
}

// Hidden reports whether Text writes r as a code: control characters but
// tab and newline; format characters (Unicode's Cf: bidirectional marks,
// embeddings, overrides and isolates, zero-width characters, the soft
// hyphen, tag characters); line and paragraph separators (U+2028, U+2029);
// characters Unicode says to draw as nothing (Other_Default_Ignorable_Code_Point:
// Hangul fillers such as U+3164, the combining grapheme joiner); and
// invalid UTF-8. Variation selectors stay: emoji use them.
func Hidden(r rune) bool {
	switch {
	case r == '\t' || r == '\n':
		return false
	case r < 0x20, r >= 0x7f && r < 0xa0, r == utf8.RuneError:
		return true
	case r < 0xa0:
		return false
	}
	return unicode.In(r, unicode.Cf, unicode.Zl, unicode.Zp, unicode.Other_Default_Ignorable_Code_Point)
}

// Writer passes what is written to it through Text on its way to w, a
// whole rune at a time (a rune split between two writes waits for its
// end). For text meant for a terminal; not for JSON, which scripts parse.
type Writer struct {
	w       io.Writer
	pending []byte
}

// NewWriter returns a Writer onto w.
func NewWriter(w io.Writer) *Writer { return &Writer{w: w} }

func (v *Writer) Write(p []byte) (int, error) {
	buf := append(v.pending, p...)
	cut := len(buf)
	// The last rune's first byte is among the last utf8.UTFMax bytes.
	for i := len(buf) - 1; i >= 0 && i >= len(buf)-utf8.UTFMax; i-- {
		if utf8.RuneStart(buf[i]) {
			if !utf8.FullRune(buf[i:]) {
				cut = i
			}
			break
		}
	}
	v.pending = append([]byte(nil), buf[cut:]...)
	if _, err := io.WriteString(v.w, Text(string(buf[:cut]))); err != nil {
		return 0, err
	}
	return len(p), nil
}
