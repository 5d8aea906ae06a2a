package ledger

import (
	"context"
	"errors"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// errCaptured stops a ledger function at its first statement.
var errCaptured = errors.New("statement captured")

// Statement returns the first statement call sends through the DB it is
// given, and its arguments, without running it: for EXPLAIN, by the plan
// tests and the benchmarks. call's function fails at that statement.
func Statement(call func(db DB)) (sql string, args []any) {
	var c capture
	call(&c)
	return c.sql, c.args
}

type capture struct {
	sql  string
	args []any
}

func (c *capture) keep(sql string, args []any) {
	if c.sql == "" {
		c.sql, c.args = sql, args
	}
}

func (c *capture) Exec(_ context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	c.keep(sql, args)
	return pgconn.CommandTag{}, errCaptured
}

func (c *capture) Query(_ context.Context, sql string, args ...any) (pgx.Rows, error) {
	c.keep(sql, args)
	return nil, errCaptured
}

func (c *capture) QueryRow(_ context.Context, sql string, args ...any) pgx.Row {
	c.keep(sql, args)
	return errRow{}
}

type errRow struct{}

func (errRow) Scan(...any) error { return errCaptured }

func (c *capture) SendBatch(_ context.Context, b *pgx.Batch) pgx.BatchResults {
	if len(b.QueuedQueries) > 0 {
		c.keep(b.QueuedQueries[0].SQL, b.QueuedQueries[0].Arguments)
	}
	return errBatch{}
}

type errBatch struct{}

func (errBatch) Exec() (pgconn.CommandTag, error) { return pgconn.CommandTag{}, errCaptured }
func (errBatch) Query() (pgx.Rows, error)         { return nil, errCaptured }
func (errBatch) QueryRow() pgx.Row                { return errRow{} }
func (errBatch) Close() error                     { return errCaptured }
func (errBatch) Tx() pgx.Tx                       { return nil }
