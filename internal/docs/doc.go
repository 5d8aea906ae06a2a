// Package docs holds the tests that keep keel's Markdown true to itself:
// every relative link in the README, BENCHMARKS.md, CHANGELOG.md and the
// guides in docs/ leads to a file that exists and, with a fragment, to a
// heading it has; and the README stays short enough to read in the first
// hour.
package docs
