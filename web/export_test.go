package web

import (
	"context"
	"time"
)

// SetCompareHook makes the server call f just before each password
// comparison, with the name being signed in.
func SetCompareHook(s *Server, f func(name string)) { s.auth.beforeCompare = f }

// SetClock makes the sign-in limits read the time from now.
func SetClock(s *Server, now func() time.Time) { s.auth.now = now }

// AccountFreeAttempts is how many attempts an account takes from unknown
// clients before it is slowed down.
const AccountFreeAttempts = accountFreeAttempts

// SitePrefixAttempts is how many sign-in attempts an IPv6 /48 gets in a
// window.
const SitePrefixAttempts = loginSiteAttemptsAllowed

// SetBulkInlineWait sets how long a bulk action's request waits for it
// before sending the operator to its progress page, until the test ends.
func SetBulkInlineWait(t interface{ Cleanup(func()) }, d time.Duration) {
	old := bulkInlineWait
	bulkInlineWait = d
	t.Cleanup(func() { bulkInlineWait = old })
}

// HashCost is the bcrypt cost HashPassword uses now.
func HashCost() int { return passwordCost }

// SetHashCost makes HashPassword hash at cost until the test ends.
func SetHashCost(t interface{ Cleanup(func()) }, cost int) {
	old := passwordCost
	passwordCost = cost
	t.Cleanup(func() { passwordCost = old })
}

// SetBulkStartingHook makes the server call f with the request's context
// once each bulk action's form is read, before its jobs are selected.
func SetBulkStartingHook(s *Server, f func(ctx context.Context)) { s.bulkStarting = f }
