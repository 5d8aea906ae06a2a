package ledger

import (
	"context"
	"time"
)

const sessionEndedSQL = `SELECT EXISTS (SELECT 1 FROM keel_web_sessions_ended WHERE session_id = $1)`

// SessionEnded reports whether the dashboard's session sid was signed out
// before its cookie's expiry.
func SessionEnded(ctx context.Context, db DB, sid string) (bool, error) {
	var ended bool
	err := db.QueryRow(ctx, sessionEndedSQL, sid).Scan(&ended)
	return ended, err
}

// endSessionSQL records a sign-out and drops the rows whose cookies have
// expired anyway.
const endSessionSQL = `WITH expired AS (DELETE FROM keel_web_sessions_ended WHERE expires_at < coalesce($3::timestamptz, now()))
	INSERT INTO keel_web_sessions_ended (session_id, expires_at) VALUES ($1, $2)
	ON CONFLICT (session_id) DO NOTHING`

// EndSession records that session sid, whose cookie expires at exp, was
// signed out, for every replica of the dashboard.
func EndSession(ctx context.Context, db DB, sid string, exp time.Time, now Now) error {
	_, err := db.Exec(ctx, endSessionSQL, sid, exp, now)
	return err
}
