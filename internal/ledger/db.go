package ledger

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// DB is what a statement runs on: a pool, a connection or a transaction.
type DB interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Now is the time a statement takes as now: nil is the database's clock.
// Statements read it as coalesce($n::timestamptz, now()).
type Now = *time.Time

// At is a Now at t, for tests that move time.
func At(t time.Time) Now { return &t }
