package cli

import (
	"bytes"
	"io"
	"os"
	"testing"

	"github.com/stretchr/testify/require"
)

// Progress bars are drawn on terminals only: not into a buffer, a pipe, a
// file or /dev/null (a character device, which a file-mode check would take
// for a terminal).
func TestNoProgressBarOffATerminal(t *testing.T) {
	devNull, err := os.OpenFile(os.DevNull, os.O_WRONLY, 0)
	require.NoError(t, err)
	defer devNull.Close()
	r, w, err := os.Pipe()
	require.NoError(t, err)
	defer r.Close()
	defer w.Close()
	file, err := os.Create(t.TempDir() + "/out")
	require.NoError(t, err)
	defer file.Close()
	for name, out := range map[string]io.Writer{"buffer": &bytes.Buffer{}, "/dev/null": devNull, "pipe": w, "file": file} {
		require.Nil(t, newProgress(out, "x", 3), name)
	}
	var p *progress // what newProgress returns off a terminal: safe to use
	p.set(1)
	p.clear()
	p.done()
}
