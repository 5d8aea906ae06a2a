// Package migrate owns the ledger's schema: the numbered migrations shipped
// inside the binary, applying them (Up), checking that a binary may use a
// database (Check), and what a version would run, for a DBA to read
// (Pending, `keel migrate --print`) before anything changes.
package migrate

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"path"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/keeljobs/keel/internal/pgerr"
	"github.com/keeljobs/keel/retry"
)

//go:embed migrations/*.sql
var migrationFS embed.FS

// Markers a migration file declares in its leading comment lines (before the
// first statement), one per line.
const (
	// MarkerNoTransaction runs the migration outside a transaction, one
	// statement at a time, so that it may use CREATE INDEX CONCURRENTLY and
	// build indexes without blocking writes. Every statement must be safe to
	// run again (IF NOT EXISTS): a failure leaves the earlier ones applied and
	// the next `keel migrate` runs them all again. Its CREATE INDEX statements
	// must be CONCURRENTLY IF NOT EXISTS with a name; an INVALID index left by
	// a failed build is dropped and built again.
	MarkerNoTransaction = "-- keel:no-transaction"
	// MarkerAdditive declares that the migration only adds: tables, indexes,
	// and columns that are nullable or have a default. A binary that predates
	// it keeps working against a database that has it (see Check).
	MarkerAdditive = "-- keel:additive"
)

// Migration is one numbered schema change shipped inside the binary.
type Migration struct {
	Version int
	Name    string
	SQL     string
	// NoTransaction is set by MarkerNoTransaction.
	NoTransaction bool
	// Additive is set by MarkerAdditive and recorded with the version, so
	// that binaries without this file can read it from the database.
	Additive bool
}

// All returns the embedded migrations in order.
func All() ([]Migration, error) {
	entries, err := fs.ReadDir(migrationFS, "migrations")
	if err != nil {
		return nil, err
	}
	var ms []Migration
	for _, e := range entries {
		name := e.Name()
		num, _, ok := strings.Cut(name, "_")
		v, err := strconv.Atoi(num)
		if !ok || err != nil {
			return nil, fmt.Errorf("keel: migration file %q is not named NNNN_name.sql", name)
		}
		body, err := migrationFS.ReadFile(path.Join("migrations", name))
		if err != nil {
			return nil, err
		}
		m, err := parseMigration(v, strings.TrimSuffix(name, ".sql"), string(body))
		if err != nil {
			return nil, err
		}
		ms = append(ms, m)
	}
	sort.Slice(ms, func(i, j int) bool { return ms[i].Version < ms[j].Version })
	return ms, nil
}

var (
	createIndexRE = regexp.MustCompile(`(?is)^CREATE\s+(UNIQUE\s+)?INDEX\b`)
	// The name is captured as written so that to_regclass and DROP INDEX
	// resolve it exactly as the CREATE does (search_path, quoting).
	concurrentIndexRE = regexp.MustCompile(`(?is)^CREATE\s+(?:UNIQUE\s+)?INDEX\s+CONCURRENTLY\s+IF\s+NOT\s+EXISTS\s+("(?:[^"]|"")+"|[\w.$]+)\s+ON\b`)
	concurrentlyRE    = regexp.MustCompile(`(?i)\bCONCURRENTLY\b`)
)

func parseMigration(version int, name, sql string) (Migration, error) {
	m := Migration{Version: version, Name: name, SQL: sql}
	for _, line := range strings.Split(sql, "\n") {
		line = strings.TrimSpace(line)
		if line == "" {
			continue
		}
		if !strings.HasPrefix(line, "--") {
			break // markers count only before the first statement
		}
		switch {
		case line == MarkerNoTransaction:
			m.NoTransaction = true
		case line == MarkerAdditive:
			m.Additive = true
		case strings.HasPrefix(line, "-- keel:"):
			return m, fmt.Errorf("keel: migration %s: unknown marker %q", name, line)
		}
	}
	stmts, err := splitStatements(sql)
	if err != nil {
		return m, fmt.Errorf("keel: migration %s: %w", name, err)
	}
	for _, s := range stmts {
		switch {
		case !m.NoTransaction && concurrentlyRE.MatchString(s):
			return m, fmt.Errorf("keel: migration %s: CONCURRENTLY needs %q", name, MarkerNoTransaction)
		case m.NoTransaction && createIndexRE.MatchString(s) && !concurrentIndexRE.MatchString(s):
			return m, fmt.Errorf("keel: migration %s: outside a transaction, an index must be built with CREATE INDEX CONCURRENTLY IF NOT EXISTS name: %.60q", name, s)
		}
	}
	return m, nil
}

// splitStatements cuts SQL into statements at semicolons outside quotes and
// comments, dropping comments. Outside a transaction each statement must be
// sent alone: several in one message run as one implicit transaction, where
// CREATE INDEX CONCURRENTLY is refused.
func splitStatements(sql string) ([]string, error) {
	var stmts []string
	var cur strings.Builder
	flush := func() {
		if s := strings.TrimSpace(cur.String()); s != "" {
			stmts = append(stmts, s)
		}
		cur.Reset()
	}
	for i := 0; i < len(sql); {
		c := sql[i]
		switch {
		case c == '-' && strings.HasPrefix(sql[i:], "--"):
			end := strings.IndexByte(sql[i:], '\n')
			if end < 0 {
				end = len(sql) - i
			}
			cur.WriteByte(' ')
			i += end
		case c == '/' && strings.HasPrefix(sql[i:], "/*"):
			end := strings.Index(sql[i+2:], "*/")
			if end < 0 {
				return nil, fmt.Errorf("unterminated comment")
			}
			cur.WriteByte(' ')
			i += end + 4
		case c == '\'' || c == '"':
			end := i + 1
			for {
				j := strings.IndexByte(sql[end:], c)
				if j < 0 {
					return nil, fmt.Errorf("unterminated quote")
				}
				end += j + 1
				if end < len(sql) && sql[end] == c { // doubled: an escaped quote
					end++
					continue
				}
				break
			}
			cur.WriteString(sql[i:end])
			i = end
		case c == '$':
			tag := dollarTagRE.FindString(sql[i:])
			if tag == "" {
				cur.WriteByte(c)
				i++
				continue
			}
			j := strings.Index(sql[i+len(tag):], tag)
			if j < 0 {
				return nil, fmt.Errorf("unterminated %s quote", tag)
			}
			end := i + len(tag) + j + len(tag)
			cur.WriteString(sql[i:end])
			i = end
		case c == ';':
			flush()
			i++
		default:
			cur.WriteByte(c)
			i++
		}
	}
	flush()
	return stmts, nil
}

var dollarTagRE = regexp.MustCompile(`^\$([A-Za-z_][A-Za-z0-9_]*)?\$`)

// Version is the newest ledger schema this build knows.
func Version() int {
	ms, err := All()
	if err != nil || len(ms) == 0 {
		return 0
	}
	return ms[len(ms)-1].Version
}

// ErrSchemaTooNew means the database was migrated by a newer keel with a
// change that is not additive, so this binary must not use it.
var ErrSchemaTooNew = fmt.Errorf("keel: ledger schema is newer than this binary")

// Result says what Up did.
type Result struct {
	From, To int
	Applied  []string
}

// migrationLock is the database's migration lock. Older keels take it
// exclusively (as a transaction lock); this one takes a share of it, so
// that ledgers in different schemas of one database migrate at once while
// an older keel's migration still excludes every other.
const migrationLock int64 = 7365434901

// schemaLock, with the hash of the schema's name as the second key, is the
// lock that serialises the migrations of one ledger.
const schemaLock int32 = 736543490

// Up brings the ledger schema up to date. It is safe to run from many
// processes at once (an advisory lock per schema serialises them) and a
// no-op when the schema is current.
//
// Each migration runs in its own transaction and is recorded in it, except
// those marked MarkerNoTransaction: they run statement by statement so that
// indexes are built with CREATE INDEX CONCURRENTLY without blocking writers,
// and are recorded only after every statement succeeded.
//
// The compatibility rule, shared with Check: a binary may use a
// database that has migrations it does not know only if every one of them is
// additive (MarkerAdditive, recorded in keel_schema_migrations). Otherwise
// Up refuses with ErrSchemaTooNew, because an old binary could corrupt
// rows it does not understand; when they are all additive it applies only
// what it knows and is missing, usually nothing.
func Up(ctx context.Context, pool *pgxpool.Pool) (Result, error) {
	ms, err := All()
	if err != nil {
		return Result{}, err
	}
	return migrate(ctx, pool, ms)
}

// Pending returns the migrations Up would apply to the ledger pool
// reaches, in order, and changes nothing: every one on a database keel has
// never migrated. It refuses a database a newer keel migrated past what
// this binary may use, as Up does (ErrSchemaTooNew). It is what
// `keel migrate --print` shows a DBA and `keel migrate --check` counts.
func Pending(ctx context.Context, pool *pgxpool.Pool) ([]Migration, error) {
	ms, err := All()
	if err != nil {
		return nil, err
	}
	var exists bool
	if err := pool.QueryRow(ctx, `SELECT to_regclass('keel_schema_migrations') IS NOT NULL`).Scan(&exists); err != nil {
		return nil, interpretError(err)
	}
	if !exists {
		return ms, nil
	}
	applied, err := appliedMigrations(ctx, pool)
	if err != nil {
		return nil, interpretError(err)
	}
	if err := tooNew(applied, ms); err != nil {
		return nil, err
	}
	var pending []Migration
	for _, m := range ms {
		if _, ok := applied[m.Version]; !ok {
			pending = append(pending, m)
		}
	}
	return pending, nil
}

func migrate(ctx context.Context, pool *pgxpool.Pool, ms []Migration) (res Result, err error) {
	pc, err := pool.Acquire(ctx)
	if err != nil {
		return res, interpretError(err)
	}
	conn := pc.Conn()
	if err := lockMigrations(ctx, conn); err != nil {
		// A cancelled try may still have taken the lock: close the session.
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		_ = pc.Hijack().Close(cctx)
		return res, err
	}
	defer func() {
		// The lock belongs to the session: a connection that cannot say it
		// unlocked is closed rather than returned to the pool holding it.
		uctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		if _, uerr := conn.Exec(uctx, `SELECT pg_advisory_unlock_shared($1), pg_advisory_unlock($2, hashtext(current_schema()))`,
			migrationLock, schemaLock); uerr != nil {
			_ = pc.Hijack().Close(uctx)
			return
		}
		pc.Release()
	}()

	if _, err := conn.Exec(ctx, `
		CREATE TABLE IF NOT EXISTS keel_schema_migrations (
			version    integer PRIMARY KEY,
			name       text NOT NULL,
			applied_at timestamptz NOT NULL DEFAULT now());
		ALTER TABLE keel_schema_migrations ADD COLUMN IF NOT EXISTS additive boolean NOT NULL DEFAULT false`); err != nil {
		return res, interpretError(err)
	}
	applied, err := appliedMigrations(ctx, conn)
	if err != nil {
		return res, err
	}
	for v := range applied {
		res.From = max(res.From, v)
	}
	res.To = res.From
	if err := tooNew(applied, ms); err != nil {
		return res, err
	}
	// Record what this binary knows about migrations an older keel applied,
	// so that binaries without their files can read it.
	var versions []int32
	var additive []bool
	for _, m := range ms {
		if _, ok := applied[m.Version]; ok {
			versions = append(versions, int32(m.Version))
			additive = append(additive, m.Additive)
		}
	}
	if _, err := conn.Exec(ctx, `UPDATE keel_schema_migrations s SET additive = f.additive
		FROM unnest($1::integer[], $2::boolean[]) AS f(version, additive)
		WHERE s.version = f.version AND s.additive <> f.additive`, versions, additive); err != nil {
		return res, interpretError(err)
	}

	// Applied by set, not by high-water mark: a migration merged after a
	// higher-numbered one still runs.
	for _, m := range ms {
		if _, ok := applied[m.Version]; ok {
			continue
		}
		if m.NoTransaction {
			err = applyNoTransaction(ctx, conn, m)
		} else {
			err = pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
				if _, err := tx.Exec(ctx, m.SQL); err != nil {
					return err
				}
				return record(ctx, tx, m)
			})
		}
		if err != nil {
			return res, fmt.Errorf("keel: migration %s: %w", m.Name, err)
		}
		res.Applied = append(res.Applied, m.Name)
		res.To = max(res.To, m.Version)
	}
	return res, nil
}

// lockMigrations takes the schema's migration lock and a share of the
// database's for conn's session. It polls instead of waiting in
// pg_advisory_lock: a waiting statement holds a snapshot, and CREATE INDEX
// CONCURRENTLY in the process holding the lock waits for every older
// snapshot to end, which would deadlock the two. On an error the caller
// closes the session, which lets go of what was taken.
func lockMigrations(ctx context.Context, conn *pgx.Conn) error {
	if err := pollLock(ctx, conn, `SELECT pg_try_advisory_lock($1, hashtext(current_schema()))`, schemaLock); err != nil {
		return err
	}
	return pollLock(ctx, conn, `SELECT pg_try_advisory_lock_shared($1)`, migrationLock)
}

func pollLock(ctx context.Context, conn *pgx.Conn, sql string, key any) error {
	for delay := 10 * time.Millisecond; ; delay = min(2*delay, time.Second) {
		var ok bool
		if err := conn.QueryRow(ctx, sql, key).Scan(&ok); err != nil {
			return interpretError(err)
		}
		if ok {
			return nil
		}
		t := time.NewTimer(delay)
		select {
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		case <-t.C:
		}
	}
}

func applyNoTransaction(ctx context.Context, conn *pgx.Conn, m Migration) error {
	stmts, err := splitStatements(m.SQL)
	if err != nil {
		return err
	}
	// On a fresh ledger there is nothing to keep writable while an index
	// builds, and a concurrent build would wait for every older transaction
	// in the whole database (other applications' too): build it plainly.
	fresh, err := ledgerEmpty(ctx, conn)
	if err != nil {
		return err
	}
	for _, s := range stmts {
		if fresh {
			s = concurrentlyRE.ReplaceAllString(s, "")
		}
		index := ""
		if sub := concurrentIndexRE.FindStringSubmatch(s); sub != nil {
			index = sub[1]
		}
		if index != "" {
			// A failed or interrupted concurrent build leaves an INVALID
			// index that IF NOT EXISTS would keep for good.
			valid, exists, err := indexValid(ctx, conn, index)
			if err != nil {
				return err
			}
			if exists && !valid {
				if _, err := conn.Exec(ctx, `DROP INDEX CONCURRENTLY IF EXISTS `+index); err != nil {
					return fmt.Errorf("drop invalid index %s: %w", index, err)
				}
			}
		}
		if _, err := conn.Exec(ctx, s); err != nil {
			return err
		}
		if index != "" {
			if valid, exists, err := indexValid(ctx, conn, index); err != nil {
				return err
			} else if !exists || !valid {
				return fmt.Errorf("index %s is not valid after it was built", index)
			}
		}
	}
	return record(ctx, conn, m)
}

// ledgerEmpty reports whether keel_jobs is missing or holds no row.
func ledgerEmpty(ctx context.Context, conn *pgx.Conn) (bool, error) {
	var missing bool
	if err := conn.QueryRow(ctx, `SELECT to_regclass('keel_jobs') IS NULL`).Scan(&missing); err != nil || missing {
		return missing, interpretError(err)
	}
	var empty bool
	err := conn.QueryRow(ctx, `SELECT NOT EXISTS (SELECT 1 FROM keel_jobs)`).Scan(&empty)
	return empty, interpretError(err)
}

func indexValid(ctx context.Context, conn *pgx.Conn, index string) (valid, exists bool, err error) {
	err = conn.QueryRow(ctx, `SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass($1)`, index).Scan(&valid)
	if errors.Is(err, pgx.ErrNoRows) {
		return false, false, nil
	}
	return valid, err == nil, err
}

// Script is the SQL a DBA runs to apply ms by hand (`keel migrate
// --print`): each migration's statements, under a comment that says how to
// run them, then the row that records it in keel_schema_migrations, as Up
// records it.
func Script(ms []Migration) string {
	var b strings.Builder
	for _, m := range ms {
		how := "in one transaction, recorded in it"
		if m.NoTransaction {
			how = "statement by statement, outside a transaction (CREATE INDEX CONCURRENTLY)"
		}
		fmt.Fprintf(&b, "-- %s: run %s\n%s\nINSERT INTO keel_schema_migrations (version, name, additive) VALUES (%d, '%s', %t);\n\n",
			m.Name, how, strings.TrimSpace(m.SQL), m.Version, m.Name, m.Additive)
	}
	return b.String()
}

type execer interface {
	Exec(context.Context, string, ...any) (pgconn.CommandTag, error)
}

func record(ctx context.Context, db execer, m Migration) error {
	_, err := db.Exec(ctx, `INSERT INTO keel_schema_migrations (version, name, additive) VALUES ($1, $2, $3)`, m.Version, m.Name, m.Additive)
	return err
}

// appliedMigrations maps each recorded version to its additive flag. A
// database only older keels migrated has no additive column: nothing in it
// counts as additive.
func appliedMigrations(ctx context.Context, db interface {
	Query(context.Context, string, ...any) (pgx.Rows, error)
}) (map[int]bool, error) {
	rows, err := db.Query(ctx, `SELECT version, coalesce((to_jsonb(m) ->> 'additive')::boolean, false)
		FROM keel_schema_migrations m`)
	if err != nil {
		return nil, err
	}
	applied := map[int]bool{}
	var v int32
	var additive bool
	_, err = pgx.ForEachRow(rows, []any{&v, &additive}, func() error {
		applied[int(v)] = additive
		return nil
	})
	return applied, err
}

// tooNew returns ErrSchemaTooNew if the database has a migration the binary
// that knows ms does not, and it is not additive.
func tooNew(applied map[int]bool, ms []Migration) error {
	known := map[int]bool{}
	newest := 0
	for _, m := range ms {
		known[m.Version] = true
		newest = max(newest, m.Version)
	}
	var blocking []int
	current := 0
	for v, additive := range applied {
		current = max(current, v)
		if !known[v] && !additive {
			blocking = append(blocking, v)
		}
	}
	if len(blocking) == 0 {
		return nil
	}
	sort.Ints(blocking)
	return fmt.Errorf("%w: database is at version %d, this keel knows up to %d and migration %v is not additive; upgrade keel",
		ErrSchemaTooNew, current, newest, blocking)
}

// Check returns an error unless this binary may use the ledger: workers
// refuse to start on a schema they cannot use. The rule:
//
//   - every migration this binary knows must be applied, else it says to run
//     `keel migrate`;
//   - migrations the binary does not know (a newer keel applied them) are
//     accepted if each is additive, so that during a rolling deploy the old
//     workers keep starting after the new binary migrated; one that is not
//     additive fails with ErrSchemaTooNew.
func Check(ctx context.Context, pool *pgxpool.Pool) error {
	return checkSchema(ctx, pool, mustMigrations())
}

func checkSchema(ctx context.Context, pool *pgxpool.Pool, ms []Migration) error {
	applied, err := appliedMigrations(ctx, pool)
	if err != nil {
		if pgerr.UndefinedTable(err) {
			return fmt.Errorf("keel: the ledger has no schema yet: run `keel migrate`")
		}
		return interpretError(err)
	}
	if err := tooNew(applied, ms); err != nil {
		return err
	}
	current := 0
	for v := range applied {
		current = max(current, v)
	}
	for _, m := range ms {
		if _, ok := applied[m.Version]; !ok {
			return fmt.Errorf("keel: ledger schema is at version %d without %s, this keel needs %d: run `keel migrate`",
				current, m.Name, ms[len(ms)-1].Version)
		}
	}
	return nil
}

func mustMigrations() []Migration {
	ms, _ := All()
	return ms
}

// interpretError marks an error of the way to Postgres as the ledger being
// unavailable (wait and try again), as every ledger caller sees it.
func interpretError(err error) error {
	if err == nil {
		return nil
	}
	if pgerr.Unreachable(err) {
		return retry.Wait(0, fmt.Errorf("%w: %w", pgerr.ErrUnavailable, err))
	}
	return fmt.Errorf("keel ledger: %w", err)
}
