package bench

import (
	"slices"
	"testing"
)

func TestMedianRowsTakesEachRowFromItsMedianRound(t *testing.T) {
	type row struct {
		ratio  float64
		rate   float64
		rounds []float64
	}
	rounds := [][]row{
		{{ratio: 1, rate: 10}, {ratio: 0.9, rate: 1}},
		{{ratio: 1, rate: 20}, {ratio: 0.3, rate: 2}},
		{{ratio: 1, rate: 30}, {ratio: 0.5, rate: 3}},
	}
	got := medianRows(rounds, func(r row) float64 { return r.ratio }, func(r *row, rs []float64) { r.rounds = rs })
	if len(got) != 2 {
		t.Fatalf("%d rows, want 2", len(got))
	}
	if got[1].rate != 3 || got[1].ratio != 0.5 {
		t.Errorf("second row from rate %v ratio %v, want the median round's (rate 3, ratio 0.5)", got[1].rate, got[1].ratio)
	}
	if want := []float64{0.9, 0.3, 0.5}; !slices.Equal(got[1].rounds, want) {
		t.Errorf("round ratios %v, want %v", got[1].rounds, want)
	}
	one := medianRows(rounds[:1], func(r row) float64 { return r.ratio }, func(r *row, rs []float64) { r.rounds = rs })
	if one[0].rounds != nil {
		t.Errorf("one round kept round ratios %v", one[0].rounds)
	}
}
