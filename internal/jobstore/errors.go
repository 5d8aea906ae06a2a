package jobstore

import (
	"errors"
	"fmt"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"

	"github.com/keeljobs/keel/internal/pgerr"
	"github.com/keeljobs/keel/retry"
)

var (
	// ErrNotFound means no ledger row matches.
	ErrNotFound = errors.New("keel: job not found")
	// ErrPastDeadline refuses a job that would run at or after its
	// deadline (a delay or run time past it, or a deadline already gone):
	// it could never run.
	ErrPastDeadline = errors.New("keel: past its deadline")
	// ErrLedgerUnavailable means Postgres could not be reached or dropped
	// the connection (a restart, a failover, a cut connection). Such errors
	// are marked retry.Wait: a job that meets one in InTx or Step waits and
	// runs again, without using up an attempt.
	ErrLedgerUnavailable = pgerr.ErrUnavailable
)

// Interpret is the one place pgx errors become keel's.
func Interpret(err error) error {
	if err == nil {
		return nil
	}
	if errors.Is(err, pgx.ErrNoRows) {
		return ErrNotFound
	}
	if pgerr.Unreachable(err) {
		return retry.Wait(0, fmt.Errorf("%w: %w", ErrLedgerUnavailable, err))
	}
	if berr := batchError(err); berr != nil {
		return berr
	}
	return fmt.Errorf("keel ledger: %w", err)
}

// MaxErrorBytes bounds the error text and summary kept with a job.
const MaxErrorBytes = 8 << 10

// StorableText makes s fit a Postgres text column: valid UTF-8, no NUL
// bytes (which Postgres refuses), at most max bytes.
func StorableText(s string, max int) string {
	if !utf8.ValidString(s) {
		s = string([]rune(s))
	}
	s = strings.ReplaceAll(s, "\x00", `\0`)
	if len(s) > max {
		cut := max
		for cut > 0 && !utf8.RuneStart(s[cut]) {
			cut--
		}
		s = s[:cut] + " …(truncated)"
	}
	return s
}

// CheckRunAt refuses a run time after a deadline: such a job could never
// run (asynq fails a delivery past its deadline unrun).
func CheckRunAt(runAt time.Time, deadline time.Time) error {
	if deadline.IsZero() || runAt.IsZero() || runAt.Before(deadline) {
		return nil
	}
	return fmt.Errorf("%w: it would run at %s, not before its deadline %s", ErrPastDeadline,
		runAt.UTC().Format(time.RFC3339), deadline.UTC().Format(time.RFC3339))
}
