package cli

import (
	"reflect"
	"testing"

	"github.com/keeljobs/keel/web"
)

// HashesWithWebHashPassword reports whether hash-password hashes with
// web.HashPassword.
func HashesWithWebHashPassword() bool {
	return reflect.ValueOf(hashPassword).Pointer() == reflect.ValueOf(web.HashPassword).Pointer()
}

// SetHashPassword makes hash-password hash with f until the test ends.
func SetHashPassword(t testing.TB, f func(password []byte) (string, error)) {
	old := hashPassword
	hashPassword = f
	t.Cleanup(func() { hashPassword = old })
}
