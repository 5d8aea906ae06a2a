package ledger

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
)

// Concurrency keys (migration 0030): admission and release are the
// keel_concurrency_admit and keel_concurrency_release triggers', in the
// transaction of whichever statement writes or ends a keyed job; these
// statements read what they did.

// KeyCount is one concurrency key of a kind as the ledger has it now.
type KeyCount struct {
	Key string
	// Limit is the key's limit as its newest open job recorded it.
	Limit int
	// InFlight counts its jobs pending, running or failed (waiting to
	// retry): those holding a slot. Running counts those a worker holds.
	InFlight, Running int
	// Held counts its jobs waiting for a slot; OldestHeld is when the
	// oldest of them was held (nil: none held).
	Held       int
	OldestHeld *time.Time
}

// concurrencyKeysSQL reads the open keys of kind $1 ($2: one key, ” for
// all), most held first, at most $3: the jobs in flight and the held ones
// each by their own index (keel_jobs_concurrency_flight, _held).
const concurrencyKeysSQL = `SELECT concurrency_key,
		(array_agg(concurrency_limit ORDER BY created_at DESC))[1],
		count(*) FILTER (WHERE status <> 'waiting'),
		count(*) FILTER (WHERE status = 'running'),
		count(*) FILTER (WHERE status = 'waiting' AND key_held_since IS NOT NULL),
		min(key_held_since)
	FROM (
		SELECT concurrency_key, concurrency_limit, created_at, status, key_held_since FROM keel_jobs
		WHERE kind = $1 AND concurrency_key IS NOT NULL AND ($2 = '' OR concurrency_key = $2)
			AND status IN ('pending', 'running', 'failed')
		UNION ALL
		SELECT concurrency_key, concurrency_limit, created_at, status, key_held_since FROM keel_jobs
		WHERE kind = $1 AND concurrency_key IS NOT NULL AND ($2 = '' OR concurrency_key = $2)
			AND status = 'waiting') k
	GROUP BY concurrency_key
	ORDER BY 5 DESC, 3 DESC, 1
	LIMIT $3`

// ConcurrencyKeys reads up to limit open concurrency keys of kind (or
// only key, when not empty), those with most held jobs first.
func ConcurrencyKeys(ctx context.Context, db DB, kind, key string, limit int) ([]KeyCount, error) {
	rows, err := db.Query(ctx, concurrencyKeysSQL, kind, key, limit)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowToStructByPos[KeyCount])
}

// KindHeld is how many jobs of one kind are held for their keys' slots,
// and since when the oldest is.
type KindHeld struct {
	Kind string
	// Held counts the jobs held, Keys the keys they wait on.
	Held, Keys int64
	OldestHeld time.Time
}

// heldByKindSQL reads, per kind, the jobs held for a concurrency slot.
// The partial index keel_jobs_waiting holds every waiting row, few unless
// keys or parents hold them.
const heldByKindSQL = `SELECT kind, count(*), count(DISTINCT concurrency_key), min(key_held_since) FROM keel_jobs
	WHERE status = 'waiting' AND key_held_since IS NOT NULL
	GROUP BY kind ORDER BY kind`

// HeldByKind reads, per kind with any, the jobs held for their concurrency
// keys' slots.
func HeldByKind(ctx context.Context, db DB) ([]KindHeld, error) {
	rows, err := db.Query(ctx, heldByKindSQL)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowToStructByPos[KindHeld])
}
