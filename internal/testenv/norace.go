//go:build !race

package testenv

// Race is true when the tests run with the race detector.
const Race = false
