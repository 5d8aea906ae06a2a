package inspect

import (
	"context"
	"fmt"

	"github.com/keeljobs/keel/internal/ledger"
)

// KeyCount is one concurrency key of a kind (tasks.ConcurrencyKey): its
// limit, its jobs in flight (pending, running, or failed and waiting to
// retry: those holding a slot), how many of them run, and the jobs held
// for a slot, with when the oldest was held.
type KeyCount = ledger.KeyCount

// DefaultKeysLimit is how many keys ConcurrencyKeys returns when asked for
// none (limit ≤ 0).
const DefaultKeysLimit = 100

// ConcurrencyKeys returns the open concurrency keys of kind — those with a
// job in flight or held — most held first, at most limit of them (≤ 0:
// DefaultKeysLimit); key, when not empty, asks for that one only. A key
// whose jobs have all ended is not listed.
func (in *Inspector) ConcurrencyKeys(ctx context.Context, kind, key string, limit int) ([]KeyCount, error) {
	if kind == "" {
		return nil, fmt.Errorf("keel: concurrency keys: which kind?")
	}
	if limit <= 0 {
		limit = DefaultKeysLimit
	}
	ks, err := ledger.ConcurrencyKeys(ctx, in.pool, kind, key, limit)
	return ks, interpret(err)
}

// HeldCount is, for one kind, the jobs held for a slot of their
// concurrency key: how many, on how many keys, since when the oldest.
type HeldCount = ledger.KindHeld

// HeldByKind returns, per kind with any, the jobs held for a slot of
// their concurrency keys.
func (in *Inspector) HeldByKind(ctx context.Context) ([]HeldCount, error) {
	hs, err := ledger.HeldByKind(ctx, in.pool)
	return hs, interpret(err)
}
