package web

import (
	"errors"
	"fmt"
	"strings"
	"unicode/utf8"

	"golang.org/x/crypto/bcrypt"
)

// Role is what a signed-in user may do.
type Role string

const (
	// RoleViewer sees everything and changes nothing.
	RoleViewer Role = "viewer"
	// RoleOperator may also replay, discard and resolve jobs, and use
	// asynqmon's write actions.
	RoleOperator Role = "operator"
)

// User is someone who signs in with a password.
type User struct {
	Name string
	Role Role
	// PasswordHash is a bcrypt hash (HashPassword).
	PasswordHash []byte
}

// PasswordCost is the bcrypt cost HashPassword uses: about 250ms on a
// server core, slow enough for guessing, fast enough to sign in.
const PasswordCost = 12

// passwordCost is the cost HashPassword uses: PasswordCost. Tests lower
// it: under the race detector one hash at PasswordCost takes seconds.
var passwordCost = PasswordCost

// MaxPasswordBytes is bcrypt's limit; longer passwords are refused rather
// than silently cut.
const MaxPasswordBytes = 72

// MinPasswordBytes is the shortest password HashPassword takes: shorter
// ones are among a guesser's first tries, whatever the sign-in limits.
const MinPasswordBytes = 8

// HashPassword returns the bcrypt hash of password for KEEL_WEB_USERS.
func HashPassword(password []byte) (string, error) {
	switch {
	case len(password) == 0:
		return "", errors.New("keel web: the password is empty")
	case len(password) < MinPasswordBytes:
		return "", fmt.Errorf("keel web: the password is %d bytes; use at least %d", len(password), MinPasswordBytes)
	case len(password) > MaxPasswordBytes:
		return "", fmt.Errorf("keel web: the password is %d bytes; bcrypt takes at most %d", len(password), MaxPasswordBytes)
	}
	h, err := bcrypt.GenerateFromPassword(password, passwordCost)
	return string(h), err
}

// ParseUsers reads KEEL_WEB_USERS: comma-separated name:role:bcrypt-hash
// entries (role is viewer or operator). Bcrypt hashes contain neither ':'
// nor ',', so no quoting is needed. Blank input means no users.
func ParseUsers(s string) ([]User, error) {
	var users []User
	for i, entry := range strings.Split(s, ",") {
		entry = strings.TrimSpace(entry)
		if entry == "" {
			continue
		}
		name, rest, ok1 := strings.Cut(entry, ":")
		role, hash, ok2 := strings.Cut(rest, ":")
		if !ok1 || !ok2 {
			return nil, fmt.Errorf("keel web: KEEL_WEB_USERS entry %d: want name:role:bcrypt-hash", i+1)
		}
		u := User{Name: strings.TrimSpace(name), Role: Role(strings.TrimSpace(role)), PasswordHash: []byte(strings.TrimSpace(hash))}
		if err := u.validate(); err != nil {
			return nil, fmt.Errorf("keel web: KEEL_WEB_USERS entry %d: %w", i+1, err)
		}
		users = append(users, u)
	}
	return users, nil
}

func (u User) validate() error {
	if err := validName(u.Name); err != nil {
		return err
	}
	if u.Role != RoleViewer && u.Role != RoleOperator {
		return fmt.Errorf("user %q: role %q: want viewer or operator", u.Name, u.Role)
	}
	if _, err := bcrypt.Cost(u.PasswordHash); err != nil {
		return fmt.Errorf("user %q: the password hash is not a bcrypt hash (make one with `keel web hash-password`)", u.Name)
	}
	return nil
}

// validName keeps user names printable and short: they are written into
// the audit log and session cookies.
func validName(name string) error {
	if name == "" || len(name) > 128 || !utf8.ValidString(name) {
		return fmt.Errorf("user name %q: want 1 to 128 bytes of UTF-8", name)
	}
	for _, r := range name {
		if r < 0x20 || r == 0x7f || r == ':' || r == ',' || r == '|' {
			return fmt.Errorf("user name %q: no control characters, ':', ',' or '|'", name)
		}
	}
	return nil
}
