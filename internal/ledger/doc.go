// Package ledger owns the SQL keel runs against its keel_* tables: every
// statement is a function here, beside a test of its query plan on a
// ledger of realistic size (plan_test.go), so that a DBA reads what keel
// asks of Postgres in one place and a change that leaves an index shows.
//
// Conventions:
//
//   - A function takes the DB it runs on (a pool, a connection or the
//     caller's transaction) and returns keel's values, not pgx rows.
//   - A statement that depends on the time takes a Now: nil means the
//     database's clock (what production passes, one clock for every
//     worker), a value moves time for a test.
//   - Errors are pgx's, untouched: the caller decides what they mean (see
//     internal/pgerr).
//
// The schema itself is the migrate package's.
package ledger
