// Package budget holds the test that keeps keel's per-job cost in check:
// it processes and enqueues a fixed set of jobs on a private Postgres and
// Redis and asserts the Postgres round trips, WAL bytes and Redis commands
// each job costs stay within budgets written next to it. Counts, not times:
// it holds on a busy host and fails on the change that adds to a hot path.
package budget
