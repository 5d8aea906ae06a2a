package web

import (
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestRingKeepsTheLastSamplesInOrder(t *testing.T) {
	t.Parallel()
	var r ring
	require.Empty(t, r.all())
	start := time.Unix(0, 0)
	for i := range SamplePoints + 5 {
		r.add(sample{At: start.Add(time.Duration(i) * time.Second), Processed: i})
	}
	all := r.all()
	require.Len(t, all, SamplePoints)
	require.Equal(t, 5, all[0].Processed, "the five oldest were overwritten")
	require.Equal(t, SamplePoints+4, all[len(all)-1].Processed)
	for i := 1; i < len(all); i++ {
		require.True(t, all[i].At.After(all[i-1].At))
	}
}

func TestRatesPerMinute(t *testing.T) {
	t.Parallel()
	t0 := time.Unix(1000, 0)
	rs := rates([]sample{
		{At: t0, Processed: 100, Failed: 10},
		{At: t0.Add(10 * time.Second), Processed: 130, Failed: 11},
		{At: t0.Add(20 * time.Second), Processed: 5, Failed: 0}, // Redis flushed: counters went down
		{At: t0.Add(20 * time.Second), Processed: 9, Failed: 0}, // same instant: skipped
	})
	require.Equal(t, []ratePoint{
		{At: t0.Add(10 * time.Second), Processed: 180, Failed: 6},
		{At: t0.Add(20 * time.Second), Processed: 0, Failed: 0},
	}, rs)
}

func TestLineChart(t *testing.T) {
	t.Parallel()
	now := time.Unix(10000, 0)
	ts := []time.Time{now.Add(-time.Hour), now.Add(-30 * time.Minute), now}
	c := lineChart(100, 20, time.Hour, now, ts, []chartLine{{Class: "a"}}, [][]float64{{0, 5, 10}})
	require.False(t, c.Empty)
	require.Equal(t, "10", c.Max)
	require.Equal(t, "last hour", c.Span)
	require.Equal(t, "0.0,18.0 50.0,10.0 100.0,2.0", c.Lines[0].Points)

	// A server that has sampled for two minutes spreads them over the width.
	ts = []time.Time{now.Add(-2 * time.Minute), now}
	c = lineChart(100, 20, time.Hour, now, ts, []chartLine{{Class: "a"}}, [][]float64{{0, 0}})
	require.Equal(t, "last 2 min", c.Span)
	require.Equal(t, "0.0,18.0 100.0,18.0", c.Lines[0].Points, "all zero: drawn on the floor")

	require.True(t, lineChart(100, 20, time.Hour, now, ts[:1], []chartLine{{}}, [][]float64{{1}}).Empty)
}

func TestSafeNext(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		"/dead?kind=a":         "/dead?kind=a",
		"/jobs/1":              "/jobs/1",
		"":                     "/",
		"dead":                 "/",
		"//evil.example":       "/",
		`/\evil.example`:       "/",
		"https://evil.example": "/",
		"/\r\nSet-Cookie: x":   "/",
		"javascript:alert(1)":  "/",
		`/./\evil.example`:     "/",
		`/x/../\evil.example`:  "/",
		"/a/./b/../c/":         "/a/c/",
	} {
		require.Equal(t, want, safeNext(in), in)
	}
}

func TestHumanDuration(t *testing.T) {
	t.Parallel()
	for d, want := range map[time.Duration]string{
		0: "0s", 42 * time.Second: "42s", 3*time.Minute + 7*time.Second: "3m07s",
		5*time.Hour + 2*time.Minute: "5h02m", 50 * time.Hour: "2d02h",
	} {
		require.Equal(t, want, humanDuration(d))
	}
	require.True(t, strings.HasSuffix(clip(strings.Repeat("é", 10), 3), "…"))
	require.Equal(t, "ééé…", clip(strings.Repeat("é", 10), 3))
}

func TestPageCSPMatchesTheStylesheet(t *testing.T) {
	t.Parallel()
	p, err := newPages()
	require.NoError(t, err)
	csp := pageCSP(string(p.css))
	require.Contains(t, csp, "style-src 'sha256-")
	require.NotEqual(t, csp, pageCSP(string(p.css)+" "), "the hash covers the exact text")
}

func TestUnescapeHTMLEscapes(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		`"\u003cb\u003e"`:    `"<b>"`,
		`"\u0026amp;"`:       `"&amp;"`,
		`"\\u003c"`:          `"\\u003c"`, // a backslash, then text
		`"\\\u003c"`:         `"\\<"`,
		`"\u00e9 \n \u003C"`: `"\u00e9 \n <"`,
		`"\`:                 `"\`,
	} {
		require.Equal(t, want, unescapeHTMLEscapes(in), in)
	}
	require.Equal(t, "not json <", prettyPayload("not json <"))
	require.Equal(t, "{\n  \"a\": \"<\"\n}", prettyPayload(`{"a":"\u003c"}`))
}
