package web

import (
	"context"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/keeljobs/keel/internal/ledger"
)

// endedSessionTimeout bounds the ledger look-up behind each signed-in
// request.
const endedSessionTimeout = 3 * time.Second

// endedSessions is the list of sessions signed out before their expiry. The
// ledger holds it (keel_web_sessions_ended), so that a signed-out cookie
// stops working on every replica sharing the secret and after a restart;
// this process also remembers its own sign-outs, which therefore hold even
// while the ledger cannot be written.
type endedSessions struct {
	pool *pgxpool.Pool

	mu    sync.Mutex
	local map[string]time.Time // session id → its cookie's expiry
}

func newEndedSessions(pool *pgxpool.Pool) *endedSessions {
	return &endedSessions{pool: pool, local: map[string]time.Time{}}
}

// has reports whether session sid was ended. When the ledger cannot say,
// it returns the error and the session is refused.
func (e *endedSessions) has(ctx context.Context, sid string) (bool, error) {
	e.mu.Lock()
	_, gone := e.local[sid]
	e.mu.Unlock()
	if gone {
		return true, nil
	}
	ctx, cancel := context.WithTimeout(ctx, endedSessionTimeout)
	defer cancel()
	return ledger.SessionEnded(ctx, e.pool, sid)
}

// end ends session sid, whose cookie expires at exp, here at once and in
// the ledger for every replica.
func (e *endedSessions) end(ctx context.Context, sid string, exp, now time.Time) error {
	e.mu.Lock()
	for id, until := range e.local {
		if now.After(until) {
			delete(e.local, id)
		}
	}
	e.local[sid] = exp
	e.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), endedSessionTimeout)
	defer cancel()
	return ledger.EndSession(ctx, e.pool, sid, exp, nil)
}
