package testenv

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/keeljobs/keel/migrate"
)

// Test schemas are reused rather than dropped and migrated for every test:
// migrating one took ~30 DDL transactions, ~200 ms of the database's time,
// and with a schema per test that was two thirds of all the work Postgres
// did in a run of the suite. A schema records, in its comment, the
// migrations it was built from and its structure once migrated; the next
// test to take it gets its tables emptied (all but the migrations' record),
// as a fresh migration would leave them, unless its structure changed since
// (a test dropped a trigger, rolled a migration back, added a table) or the
// migrations did: then it is dropped and migrated again.

var (
	slotsMu   sync.Mutex
	freeSlots []string                // private schemas this process holds, free
	heldSlots = map[string]*os.File{} // their locks, held while the process lives

	builtFrom = sync.OnceValues(func() (string, error) {
		ms, err := migrate.All()
		if err != nil {
			return "", err
		}
		h := sha256.New()
		for _, m := range ms {
			fmt.Fprintf(h, "%d %s %d\n%s\n", m.Version, m.Name, len(m.SQL), m.SQL)
		}
		return hex.EncodeToString(h.Sum(nil))[:16], nil
	})
)

// takeSlot returns a private schema this process holds and no test is
// using: a free one, or keel_test_slot_N, N the first number no other
// process holds (a file lock kept until the process exits). A run leaves its
// slots behind for the next process, not a schema per test.
func takeSlot(t testing.TB) string {
	t.Helper()
	slotsMu.Lock()
	defer slotsMu.Unlock()
	if n := len(freeSlots); n > 0 {
		s := freeSlots[n-1]
		freeSlots = freeSlots[:n-1]
		return s
	}
	for n := 1; ; n++ {
		name := fmt.Sprintf("keel_test_slot_%d", n)
		if heldSlots[name] != nil {
			continue
		}
		f, err := os.OpenFile(filepath.Join(os.TempDir(), "keel-testenv-"+name+".lock"), os.O_CREATE|os.O_RDWR, 0o600)
		if err != nil {
			t.Fatalf("testenv: lock file: %v", err)
		}
		if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
			f.Close()
			if errors.Is(err, syscall.EWOULDBLOCK) {
				continue // another test process holds it
			}
			t.Fatalf("testenv: lock: %v", err)
		}
		heldSlots[name] = f // kept open: a collected file would close, and unlock
		return name
	}
}

func putSlot(schema string) {
	slotsMu.Lock()
	freeSlots = append(freeSlots, schema)
	slotsMu.Unlock()
}

// freshPool returns a pool on schema, fresh: emptied if it was built from
// today's migrations and still has the structure they gave it, else
// (re)created and migrated. The pool is closed when the test ends; release,
// if set, runs after that. With private, a schema that another session
// still uses (a worker process, a handler of an earlier test that hangs on
// in the background) is left to it: freshPool returns nil.
func freshPool(t testing.TB, schema string, private bool, release func()) *pgxpool.Pool {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	from, err := builtFrom()
	if err != nil {
		t.Fatal(err)
	}
	if err := ensureDatabase(ctx, DatabaseURL()); err != nil {
		t.Fatal(err)
	}
	emptied := false
	switch used, err := inUse(ctx, schema); {
	case err != nil:
		t.Fatalf("testenv: schema %s: %v", schema, err)
	case used && private:
		return nil
	case !used:
		emptied, err = empty(ctx, schema, from)
		if err != nil && private {
			return nil // locked by a session that came after all
		}
		if err != nil {
			t.Fatalf("testenv: schema %s: %v", schema, err)
		}
	}
	var cfg *pgxpool.Config
	if emptied {
		cfg, err = poolConfig(schema)
	} else {
		cfg, err = PoolConfig(ctx, schema) // drops and creates it
	}
	if err != nil {
		t.Fatal(err)
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		pool.Close()
		if release != nil {
			release()
		}
	})
	if emptied {
		return pool
	}
	if _, err := migrate.Up(ctx, pool); err != nil {
		t.Fatalf("testenv: migrate: %v", err)
	}
	var print string
	if err := pool.QueryRow(ctx, fingerprintSQL(schema)).Scan(&print); err != nil {
		t.Fatalf("testenv: schema %s: %v", schema, err)
	}
	ident := pgx.Identifier{schema}.Sanitize()
	if _, err := pool.Exec(ctx, "COMMENT ON SCHEMA "+ident+" IS "+quote(from+" "+print)); err != nil {
		t.Fatalf("testenv: schema %s: %v", schema, err)
	}
	return pool
}

// inUse says whether sessions of schema (application_name, see poolConfig)
// other than its caller's are connected. A pool's closed connections take a
// moment to go, so it waits up to a second for them.
func inUse(ctx context.Context, schema string) (bool, error) {
	conn, err := connect(ctx, DatabaseURL())
	if err != nil {
		return false, err
	}
	defer conn.Close(ctx)
	for range 50 {
		var n int
		if err := conn.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE application_name = $1`, schema).Scan(&n); err != nil {
			return false, err
		}
		if n == 0 {
			return false, nil
		}
		time.Sleep(20 * time.Millisecond)
	}
	return true, nil
}

// empty makes schema as a fresh migration leaves it, if its comment says it
// was built from migrations from and keel's part of it has the structure the
// comment records: it drops the tables, sequences, types and functions a test
// added beside keel's and truncates keel's tables (but the migrations'
// record), starting their identities again. It says whether it did.
// Truncated, not deleted from: dead rows would stay in the tables and their
// indexes, and a test of what a query reads, or of its plan, would see them.
func empty(ctx context.Context, schema, from string) (bool, error) {
	conn, err := connect(ctx, DatabaseURL())
	if err != nil {
		return false, err
	}
	defer conn.Close(ctx)
	var comment string
	err = conn.QueryRow(ctx, `SELECT coalesce(obj_description(oid, 'pg_namespace'), '') FROM pg_namespace WHERE nspname = $1`,
		schema).Scan(&comment)
	if errors.Is(err, pgx.ErrNoRows) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	wantFrom, wantPrint, _ := strings.Cut(comment, " ")
	if wantFrom != from {
		return false, nil
	}
	tx, err := conn.Begin(ctx)
	if err != nil {
		return false, err
	}
	defer tx.Rollback(ctx) //nolint:errcheck // after Commit, a no-op
	// The search path as the print was taken: definitions name what is off it.
	if _, err := tx.Exec(ctx, "SET LOCAL lock_timeout = '5s'; SET LOCAL search_path TO "+pgx.Identifier{schema}.Sanitize()); err != nil {
		return false, err
	}
	var print string
	if err := tx.QueryRow(ctx, fingerprintSQL(schema)).Scan(&print); err != nil || print != wantPrint {
		// A test changed keel's part, or what the structure is read from.
		return false, nil //nolint:nilerr // migrated anew, which shows any other cause
	}
	rows, err := tx.Query(ctx, `
		SELECT format('DROP %s IF EXISTS %I CASCADE', CASE relkind WHEN 'v' THEN 'VIEW' WHEN 'm' THEN 'MATERIALIZED VIEW'
		       WHEN 'S' THEN 'SEQUENCE' WHEN 'f' THEN 'FOREIGN TABLE' WHEN 'c' THEN 'TYPE' ELSE 'TABLE' END, relname)
		  FROM pg_class WHERE relnamespace = $1::text::regnamespace AND relkind IN ('r', 'p', 'v', 'm', 'S', 'f', 'c')
		   AND relname NOT LIKE 'keel\_%'
		UNION ALL
		SELECT format('DROP TYPE IF EXISTS %I CASCADE', typname) FROM pg_type
		 WHERE typnamespace = $1::text::regnamespace AND typtype IN ('e', 'd', 'r', 'm') AND typname NOT LIKE 'keel\_%'
		UNION ALL
		SELECT format('DROP FUNCTION IF EXISTS %s CASCADE', oid::regprocedure) FROM pg_proc
		 WHERE pronamespace = $1::text::regnamespace AND proname NOT LIKE 'keel\_%'
		UNION ALL
		SELECT 'TRUNCATE ' || string_agg(format('%I', tablename), ', ') || ' RESTART IDENTITY' FROM pg_tables
		 WHERE schemaname = $1::text AND tablename LIKE 'keel\_%' AND tablename <> 'keel_schema_migrations'`, schema)
	if err != nil {
		return false, err
	}
	stmts, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return false, err
	}
	if _, err := tx.Exec(ctx, strings.Join(stmts, "; ")); err != nil {
		return false, err
	}
	return true, tx.Commit(ctx)
}

func quote(s string) string { return "'" + strings.ReplaceAll(s, "'", "''") + "'" }

// fingerprintSQL sums up the structure of keel's part of a schema (what
// is named keel_*, and every trigger on its tables) in one value: relations,
// columns, constraints, indexes, functions, triggers and the migrations it
// records as applied.
func fingerprintSQL(schema string) string {
	ns := quote(schema) + "::regnamespace"
	return `WITH keel AS (SELECT oid, relname, relkind FROM pg_class
	 WHERE relnamespace = ` + ns + ` AND relname LIKE 'keel\_%')
SELECT md5(string_agg(d, E'\n' ORDER BY d)) FROM (
	SELECT 'rel ' || c.relname || ' ' || c.relkind::text || ' ' || coalesce(pg_get_indexdef(i.indexrelid), '') AS d
	  FROM keel c LEFT JOIN pg_index i ON i.indexrelid = c.oid
	UNION ALL
	SELECT 'col ' || c.relname || '.' || a.attname || ' ' || format_type(a.atttypid, a.atttypmod) || ' ' ||
	       a.attnotnull || ' ' || coalesce(pg_get_expr(ad.adbin, ad.adrelid), '')
	  FROM pg_attribute a JOIN keel c ON c.oid = a.attrelid
	  LEFT JOIN pg_attrdef ad ON ad.adrelid = a.attrelid AND ad.adnum = a.attnum
	 WHERE a.attnum > 0 AND NOT a.attisdropped
	UNION ALL
	SELECT 'con ' || c.relname || ' ' || conname || ' ' || pg_get_constraintdef(k.oid) || ' ' || convalidated
	  FROM pg_constraint k JOIN keel c ON c.oid = k.conrelid
	UNION ALL
	SELECT 'idx ' || c.relname || ' ' || pg_get_indexdef(i.indexrelid)
	  FROM pg_index i JOIN keel c ON c.oid = i.indrelid
	UNION ALL
	SELECT 'fn ' || p.proname || '(' || pg_get_function_identity_arguments(p.oid) || ') ' || md5(p.prosrc)
	  FROM pg_proc p WHERE p.pronamespace = ` + ns + ` AND p.proname LIKE 'keel\_%'
	UNION ALL
	SELECT 'trg ' || pg_get_triggerdef(t.oid) || ' ' || t.tgenabled::text
	  FROM pg_trigger t JOIN keel c ON c.oid = t.tgrelid WHERE NOT t.tgisinternal
	UNION ALL
	SELECT 'migrated ' || version || ' ' || name || ' ' || additive FROM ` + pgx.Identifier{schema}.Sanitize() + `.keel_schema_migrations
) x`
}
