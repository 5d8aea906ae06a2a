// Package pgerr sorts Postgres errors for every keel package that talks to
// the ledger: an error of the way to Postgres (wait and try again) from a
// statement Postgres refused. It sits below them all, so that the ledger,
// the migrations and the handler's API recognise the same errors.
package pgerr

import (
	"errors"
	"io"
	"net"
	"strings"
	"syscall"

	"github.com/jackc/pgx/v5/pgconn"
)

// ErrUnavailable marks an error of the way to the ledger (idempotency's
// ErrLedgerUnavailable is this value).
var ErrUnavailable = errors.New("keel: ledger unavailable")

// Unreachable tells an error of the way to Postgres (refused, cut, shut
// down, a standby that cannot take writes) from a statement Postgres
// refused. A cancelled or timed-out context is neither: its caller gave up.
func Unreachable(err error) bool {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		switch pgErr.Code {
		case "57P01", // admin_shutdown: fast shutdown, pg_terminate_backend
			"57P02", // crash_shutdown
			"57P03", // cannot_connect_now: starting up, shutting down
			"53300", // too_many_connections: every connection slot taken
			"25006": // read_only_sql_transaction: a standby, mid-failover
			return true
		}
		return strings.HasPrefix(pgErr.Code, "08") // connection exception
	}
	if pgconn.Timeout(err) {
		return false
	}
	var connErr *pgconn.ConnectError
	// Not pgconn.SafeToRetry: it also holds for a connection used by two
	// goroutines at once, a bug that waiting does not mend.
	if errors.As(err, &connErr) || errors.Is(err, pgconn.ErrConnClosed) {
		return true
	}
	var opErr *net.OpError
	return errors.As(err, &opErr) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.EPIPE)
}

// UndefinedTable reports Postgres's undefined_table: the ledger has no
// schema (yet), or not this table.
func UndefinedTable(err error) bool { return Code(err) == "42P01" }

// LockConflict tells a statement Postgres aborted to break a deadlock or a
// serialization conflict: nothing of it happened, and run again it may pass.
func LockConflict(err error) bool {
	c := Code(err)
	return c == "40P01" || c == "40001"
}

// Code is the SQLSTATE of a statement Postgres refused, or "".
func Code(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code
	}
	return ""
}
