package executor

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"syscall"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/keeljobs/keel/internal/jobstore"
	"github.com/keeljobs/keel/retry"
)

func TestLedgerUnreachable(t *testing.T) {
	for _, c := range []struct {
		name string
		err  error
		want bool
	}{
		{"terminated (pg_terminate_backend, fast shutdown)", &pgconn.PgError{Code: "57P01"}, true},
		{"starting up", &pgconn.PgError{Code: "57P03"}, true},
		{"every connection slot taken", &pgconn.PgError{Code: "53300", Message: "sorry, too many clients already"}, true},
		{"connection failure", &pgconn.PgError{Code: "08006"}, true},
		{"a standby refuses writes", &pgconn.PgError{Code: "25006"}, true},
		{"refused to connect", &pgconn.ConnectError{}, true},
		{"closed connection", fmt.Errorf("x: %w", pgconn.ErrConnClosed), true},
		{"cut mid-answer", io.ErrUnexpectedEOF, true},
		{"reset", &net.OpError{Op: "read", Err: syscall.ECONNRESET}, true},
		{"unique violation", &pgconn.PgError{Code: "23505"}, false},
		{"serialization failure", &pgconn.PgError{Code: "40001"}, false},
		{"no rows", pgx.ErrNoRows, false},
		{"cancelled", context.Canceled, false},
		{"deadline", context.DeadlineExceeded, false},
		{"other", errors.New("boom"), false},
	} {
		t.Run(c.name, func(t *testing.T) {
			if got := ledgerUnreachable(c.err); got != c.want {
				t.Fatalf("ledgerUnreachable(%v) = %v, want %v", c.err, got, c.want)
			}
			err := interpretError(c.err)
			if c.err == pgx.ErrNoRows {
				return
			}
			if got := errors.Is(err, jobstore.ErrLedgerUnavailable) && retry.IsWait(err); got != c.want {
				t.Fatalf("interpretError(%v) = %v: a wait for an unreachable ledger: %v, want %v", c.err, err, got, c.want)
			}
			if !errors.Is(err, c.err) {
				t.Fatalf("interpretError(%v) lost the cause: %v", c.err, err)
			}
		})
	}
}
