package visible_test

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/internal/visible"
)

func TestTextShowsWhatWouldActOnTheScreen(t *testing.T) {
	for in, want := range map[string]string{
		"plain text, tabs\tand\nnewlines": "plain text, tabs\tand\nnewlines",
		"ünïcödé 注文":                      "ünïcödé 注文",
		"red \x1b[31m bell \x07":          "red [U+001B][31m bell [U+0007]",
		"\u202edesrever":                  "[U+202E]desrever",
		"zero\u200bwidth\ufeff":           "zero[U+200B]width[U+FEFF]",
		"bad \xff byte":                   "bad [U+FFFD] byte",
		"c1 \u0085 control":               "c1 [U+0085] control",
		"soft\u00adhyphen":                "soft[U+00AD]hyphen",
		"line\u2028para\u2029":            "line[U+2028]para[U+2029]",
		"tag\U000e0041\U000e007f":         "tag[U+E0041][U+E007F]",
		"hangul\u3164filler\uffa0\u115f":  "hangul[U+3164]filler[U+FFA0][U+115F]",
		"cgj\u034f mvs\u180e":             "cgj[U+034F] mvs[U+180E]",
		"emoji stay: é 👍🏽 ❤️":             "emoji stay: é 👍🏽 ❤️",
	} {
		require.Equal(t, want, visible.Text(in), "%q", in)
	}
}

func TestWriterKeepsRunesWhole(t *testing.T) {
	var out strings.Builder
	w := visible.NewWriter(&out)
	in := "a\x1b[2Jb é\u202e注"
	// One byte at a time: no rune arrives whole in one write.
	for i := range len(in) {
		n, err := w.Write([]byte{in[i]})
		require.NoError(t, err)
		require.Equal(t, 1, n)
	}
	require.Equal(t, visible.Text(in), out.String())
	require.Equal(t, "a[U+001B][2Jb é[U+202E]注", out.String())
}
