package ledger

import (
	"errors"
	"fmt"
	"strings"
	"unicode/utf8"
)

// What the ledger can store as a key and a queue name: the rules every
// writer (clients, kinds, workers, the handler's steps) checks before a
// statement is sent.

// MaxBusinessKeyBytes bounds a business key so it always fits the unique index.
const MaxBusinessKeyBytes = 1024

// ValidateKey reports why s cannot be stored as a kind or business key:
// Postgres text cannot hold NUL bytes or invalid UTF-8, and the unique index
// has a size limit.
func ValidateKey(what, s string) error {
	switch {
	case s == "":
		return fmt.Errorf("%s is empty", what)
	case strings.TrimSpace(s) == "":
		return fmt.Errorf("%s is blank", what)
	case len(s) > MaxBusinessKeyBytes:
		return fmt.Errorf("%s is %d bytes, over the %d-byte limit", what, len(s), MaxBusinessKeyBytes)
	case !utf8.ValidString(s):
		return fmt.Errorf("%s is not valid UTF-8", what)
	}
	for i := 0; i < len(s); i++ {
		if s[i] == 0 {
			return fmt.Errorf("%s contains a NUL byte", what)
		}
	}
	return nil
}

// MaxQueueBytes bounds a queue name.
const MaxQueueBytes = 100

// ValidateQueue reports why q cannot name a queue: the one rule workers,
// kinds and clients share. Letters, digits, '-', '_' and '.': asynq keys a
// queue as asynq:{q}:…, so braces would change its hash slot, and ':' and
// ',' separate queues and weights in --queues.
func ValidateQueue(q string) error {
	if q == "" {
		return errors.New("queue name is empty")
	}
	if len(q) > MaxQueueBytes {
		return fmt.Errorf("queue name is %d bytes, over the %d-byte limit", len(q), MaxQueueBytes)
	}
	for _, r := range q {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-' || r == '_' || r == '.') {
			return fmt.Errorf("queue name %q has %q: use letters, digits, '-', '_' and '.'", q, r)
		}
	}
	return nil
}
