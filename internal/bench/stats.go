package bench

import (
	"cmp"
	"fmt"
	"slices"
	"strings"
	"time"
)

// Latency summarises measured durations, in milliseconds.
type Latency struct {
	P50 float64 `json:"p50_ms"`
	P90 float64 `json:"p90_ms"`
	P99 float64 `json:"p99_ms"`
	Max float64 `json:"max_ms"`
}

// summarize returns the percentiles of ds (nearest rank); it sorts ds.
func summarize(ds []time.Duration) Latency {
	if len(ds) == 0 {
		return Latency{}
	}
	slices.Sort(ds)
	at := func(p float64) float64 {
		i := int(p*float64(len(ds))+0.999999) - 1
		i = min(max(i, 0), len(ds)-1)
		return ms(ds[i])
	}
	return Latency{P50: at(0.50), P90: at(0.90), P99: at(0.99), Max: ms(ds[len(ds)-1])}
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// fmtMs renders milliseconds with a precision that suits their size.
func fmtMs(v float64) string {
	switch {
	case v < 1:
		return fmt.Sprintf("%.3f", v)
	case v < 10:
		return fmt.Sprintf("%.2f", v)
	case v < 100:
		return fmt.Sprintf("%.1f", v)
	}
	return fmt.Sprintf("%.0f", v)
}

// ratio is a/b, or 0 when b is 0.
func ratio(a, b float64) float64 {
	if b == 0 {
		return 0
	}
	return a / b
}

// medianRows merges rounds of the same rows: each row is taken from the
// round in which its ratio was the median one, and keeps every round's
// ratio (through keep) so a reader sees the spread. Ratios are compared
// within a round, against a baseline measured in that same round, so a
// busy moment in one round does not mix into another's figures.
func medianRows[T any](rounds [][]T, ratio func(T) float64, keep func(*T, []float64)) []T {
	if len(rounds) == 0 {
		return nil
	}
	out := make([]T, 0, len(rounds[0]))
	for i := range rounds[0] {
		var idx []int
		var ratios []float64
		for r := range rounds {
			if i < len(rounds[r]) {
				idx = append(idx, r)
				ratios = append(ratios, ratio(rounds[r][i]))
			}
		}
		order := make([]int, len(idx))
		for k := range order {
			order[k] = k
		}
		slices.SortFunc(order, func(a, b int) int { return cmp.Compare(ratios[a], ratios[b]) })
		row := rounds[idx[order[(len(order)-1)/2]]][i]
		if len(ratios) > 1 {
			keep(&row, ratios)
		}
		out = append(out, row)
	}
	return out
}

// roundSuffix names round i of n in progress lines; empty for one round.
func roundSuffix(i, n int) string {
	if n <= 1 {
		return ""
	}
	return fmt.Sprintf(" (round %d of %d)", i+1, n)
}

// roundsHeader is the rounds column's heading, when there were rounds.
func roundsHeader(rounds int) string {
	if rounds > 1 {
		return "rounds\t"
	}
	return ""
}

// fmtRounds lists the ratios of every round, for the rounds column.
func fmtRounds(ratios []float64) string {
	if len(ratios) == 0 {
		return ""
	}
	parts := make([]string, len(ratios))
	for i, r := range ratios {
		parts[i] = fmt.Sprintf("%.2f", r)
	}
	return strings.Join(parts, " ") + "\t"
}
