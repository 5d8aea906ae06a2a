package web

import "time"

// SetCompareHook makes the server call f just before each password
// comparison, with the name being signed in.
func SetCompareHook(s *Server, f func(name string)) { s.auth.beforeCompare = f }

// SetClock makes the sign-in limits read the time from now.
func SetClock(s *Server, now func() time.Time) { s.auth.now = now }

// AccountSpacing is how far apart a slowed-down account's attempts are.
const AccountSpacing = loginAccountSpacing
