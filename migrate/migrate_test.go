package migrate_test

import (
	"context"
	"fmt"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/internal/testenv"
	"github.com/keeljobs/keel/migrate"
)

// migratePool is a second pool on the test schema whose sessions carry their
// own application_name, so that the test can watch them in pg_stat_activity
// apart from every other test run sharing the database.
func migratePool(t *testing.T, base *pgxpool.Pool, name string) (*pgxpool.Pool, string) {
	t.Helper()
	cfg := base.Config().Copy()
	app := fmt.Sprintf("keel-test-%s-%d", name, os.Getpid())
	cfg.ConnConfig.RuntimeParams["application_name"] = app
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool, app
}

// waitForQuery waits until a session of app runs a statement mentioning
// substr (waiting on a lock if waiting is set).
func waitForQuery(t *testing.T, pool *pgxpool.Pool, app, substr string, waiting bool, sessions int) {
	t.Helper()
	testenv.Eventually(t, 20*time.Second, func() bool {
		var n int
		require.NoError(t, pool.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_activity
			WHERE application_name = $1 AND strpos(query, $2) > 0 AND (NOT $3 OR wait_event_type = 'Lock')`,
			app, substr, waiting).Scan(&n))
		return n >= sessions
	}, "%d session(s) of %s running %q", sessions, app, substr)
}

func indexState(t *testing.T, pool *pgxpool.Pool, name string) (exists, valid bool) {
	t.Helper()
	err := pool.QueryRow(context.Background(),
		`SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass($1)`, name).Scan(&valid)
	if err == pgx.ErrNoRows {
		return false, false
	}
	require.NoError(t, err)
	return true, valid
}

func recorded(t *testing.T, pool *pgxpool.Pool) map[int]bool {
	t.Helper()
	rows, err := pool.Query(context.Background(), `SELECT version, additive FROM keel_schema_migrations`)
	require.NoError(t, err)
	got := map[int]bool{}
	var v int32
	var additive bool
	_, err = pgx.ForEachRow(rows, []any{&v, &additive}, func() error { got[int(v)] = additive; return nil })
	require.NoError(t, err)
	return got
}

func TestMigrateRacingOnAnEmptySchemaIsSerialisedAndIdempotent(t *testing.T) {
	setup(t) // the package's lock: its schema is not touched here
	ctx := context.Background()
	cfg, err := testenv.PoolConfig(ctx, schema+"_migrate")
	require.NoError(t, err)
	base, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(base.Close)
	a, app := migratePool(t, base, "race")
	b, _ := migratePool(t, base, "race")

	// Hold the migration lock so that both calls are waiting for it when it
	// is released: the loser waits while the winner builds indexes
	// concurrently, which must neither fail nor deadlock.
	holder, err := base.Acquire(ctx)
	require.NoError(t, err)
	defer holder.Release()
	_, err = holder.Exec(ctx, `SELECT pg_advisory_lock(7365434901)`)
	require.NoError(t, err)

	ms, err := migrate.All()
	require.NoError(t, err)
	results := make([]migrate.Result, 2)
	errs := make([]error, 2)
	var wg sync.WaitGroup
	for i, p := range []*pgxpool.Pool{a, b} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			results[i], errs[i] = migrate.Up(ctx, p)
		}()
	}
	waitForQuery(t, base, app, "advisory", false, 2)
	_, err = holder.Exec(ctx, `SELECT pg_advisory_unlock(7365434901)`)
	require.NoError(t, err)
	wg.Wait()
	require.NoError(t, errs[0])
	require.NoError(t, errs[1])
	applied := len(results[0].Applied) + len(results[1].Applied)
	require.Equal(t, len(ms), applied, "one call applies everything, the other nothing: %v", results)
	require.True(t, len(results[0].Applied) == 0 || len(results[1].Applied) == 0, "%v", results)

	res, err := migrate.Up(ctx, a)
	require.NoError(t, err)
	require.Empty(t, res.Applied)
	require.Equal(t, migrate.Version(), res.To)
	require.NoError(t, migrate.Check(ctx, a))

	var invalid int
	require.NoError(t, base.QueryRow(ctx, `SELECT count(*) FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
		WHERE c.relnamespace = $1::regnamespace AND NOT i.indisvalid`, schema+"_migrate").Scan(&invalid))
	require.Zero(t, invalid)
	want := map[int]bool{}
	for _, m := range ms {
		want[m.Version] = m.Additive
	}
	require.Equal(t, want, recorded(t, base))
}

// unapplyRunningLease takes the database back to before migration 0006,
// whose concurrent index build the tests below interrupt. The later
// migrations are additive and re-apply as no-ops.
func unapplyRunningLease(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	_, err := pool.Exec(context.Background(), `DROP INDEX keel_jobs_running_lease;
		DELETE FROM keel_schema_migrations WHERE version >= 6`)
	require.NoError(t, err)
}

// holdWriter opens a transaction that wrote to keel_jobs and keeps it open:
// a concurrent index build must wait for it to end.
func holdWriter(t *testing.T, pool *pgxpool.Pool) pgx.Tx {
	t.Helper()
	ctx := context.Background()
	_, err := pool.Exec(ctx, `INSERT INTO keel_jobs (id, kind, business_key, queue, payload, max_retry)
		VALUES ('held', 'test:migrate', 'held', 'default', '\x', 0)`)
	require.NoError(t, err)
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback(ctx) })
	_, err = tx.Exec(ctx, `UPDATE keel_jobs SET attempts = attempts + 1 WHERE id = 'held'`)
	require.NoError(t, err)
	return tx
}

func TestMigrateDoesNotBlockWritersWhileItBuildsAnIndex(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	unapplyRunningLease(t, b.pool)
	mp, app := migratePool(t, b.pool, "build")
	held := holdWriter(t, b.pool) // after the pool: cleanups end the writer before closing it
	done := make(chan error, 1)
	go func() {
		_, err := migrate.Up(ctx, mp)
		done <- err
	}()
	waitForQuery(t, b.pool, app, "keel_jobs_running_lease", true, 1)

	// The build waits for the held writer; new writers must not queue behind
	// it, as they would behind a plain CREATE INDEX's share lock.
	err := pgx.BeginFunc(ctx, b.pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SET LOCAL lock_timeout = '3s'`); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, `INSERT INTO keel_jobs (id, kind, business_key, queue, payload, max_retry)
			VALUES ('writer', 'test:migrate', 'writer', 'default', '\x', 0)`)
		return err
	})
	require.NoError(t, err, "a writer was blocked by the index build")

	require.NoError(t, held.Commit(ctx))
	require.NoError(t, <-done)
	exists, valid := indexState(t, b.pool, "keel_jobs_running_lease")
	require.True(t, exists && valid)
	require.Contains(t, recorded(t, b.pool), 6)
	require.NoError(t, migrate.Check(ctx, b.pool))
}

func TestMigrateRebuildsAnIndexAnInterruptedBuildLeftInvalid(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	unapplyRunningLease(t, b.pool)
	mp, app := migratePool(t, b.pool, "interrupt")
	held := holdWriter(t, b.pool)
	mctx, cancel := context.WithCancel(ctx)
	defer cancel()
	done := make(chan error, 1)
	go func() {
		_, err := migrate.Up(mctx, mp)
		done <- err
	}()
	waitForQuery(t, b.pool, app, "keel_jobs_running_lease", true, 1)
	exists, valid := indexState(t, b.pool, "keel_jobs_running_lease")
	require.True(t, exists && !valid, "a concurrent build in progress shows as an invalid index")
	cancel() // the deploy's migrate is killed mid-build
	require.Error(t, <-done)

	exists, valid = indexState(t, b.pool, "keel_jobs_running_lease")
	require.True(t, exists && !valid, "the interrupted build left an invalid index")
	require.NotContains(t, recorded(t, b.pool), 6, "recorded only once it succeeded")
	require.ErrorContains(t, migrate.Check(ctx, b.pool), "run `keel migrate`")

	require.NoError(t, held.Commit(ctx))
	res, err := migrate.Up(ctx, b.pool)
	require.NoError(t, err)
	require.NotEmpty(t, res.Applied)
	require.Equal(t, "0006_running_lease", res.Applied[0])
	exists, valid = indexState(t, b.pool, "keel_jobs_running_lease")
	require.True(t, exists && valid, "the next migrate rebuilt the index")
	require.NoError(t, migrate.Check(ctx, b.pool))
}

// An old binary is simulated by the migration list minus the newest ones.
func oldBinary(t *testing.T, newest int) []migrate.Migration {
	t.Helper()
	ms, err := migrate.All()
	require.NoError(t, err)
	return ms[:len(ms)-newest]
}

// newestVersion is this binary's newest migration. The tests below assume
// it and the one before it are additive.
func newestVersion(t *testing.T) int {
	t.Helper()
	ms, err := migrate.All()
	require.NoError(t, err)
	require.GreaterOrEqual(t, len(ms), 2)
	require.True(t, ms[len(ms)-1].Additive && ms[len(ms)-2].Additive, "the two newest migrations are additive")
	return ms[len(ms)-1].Version
}

func TestSchemaOlderBinaryStartsWhenNewerMigrationsAreAdditive(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	all := oldBinary(t, 0)
	newest := newestVersion(t)
	before := recorded(t, b.pool)
	for _, older := range []int{1, 2} { // one and two versions behind: both additive
		old := oldBinary(t, older)
		require.NoError(t, migrate.CheckWith(ctx, b.pool, old), "%d behind", older)
		res, err := migrate.UpWith(ctx, b.pool, old)
		require.NoError(t, err, "migrate from an old binary is a no-op")
		require.Empty(t, res.Applied)
		require.Equal(t, newest, res.To)
	}
	require.Equal(t, before, recorded(t, b.pool))
	require.NoError(t, migrate.CheckWith(ctx, b.pool, all))

	// A newer keel's additive migration does not stop this binary either.
	_, err := b.pool.Exec(ctx, `INSERT INTO keel_schema_migrations (version, name, additive) VALUES ($1, 'future', true)`, newest+1)
	require.NoError(t, err)
	require.NoError(t, migrate.Check(ctx, b.pool))
	_, err = migrate.Up(ctx, b.pool)
	require.NoError(t, err)
}

func TestSchemaOlderBinaryRefusesANewerMigrationThatIsNotAdditive(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	old := oldBinary(t, 1)
	newest := newestVersion(t)
	_, err := b.pool.Exec(ctx, `UPDATE keel_schema_migrations SET additive = false WHERE version = $1`, newest)
	require.NoError(t, err)
	require.ErrorIs(t, migrate.CheckWith(ctx, b.pool, old), migrate.ErrSchemaTooNew)
	_, err = migrate.UpWith(ctx, b.pool, old)
	require.ErrorIs(t, err, migrate.ErrSchemaTooNew)
	// The binary that knows the newest migration may use it.
	require.NoError(t, migrate.Check(ctx, b.pool))

	_, err = b.pool.Exec(ctx, `INSERT INTO keel_schema_migrations (version, name) VALUES ($1, 'future')`, newest+1)
	require.NoError(t, err)
	err = migrate.Check(ctx, b.pool)
	require.ErrorIs(t, err, migrate.ErrSchemaTooNew)
	require.ErrorContains(t, err, fmt.Sprintf("[%d]", newest+1))
}

func TestSchemaBehindTheBinaryMustBeMigrated(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	_, err := b.pool.Exec(ctx, `DELETE FROM keel_schema_migrations WHERE version = $1`, newestVersion(t))
	require.NoError(t, err)
	err = migrate.Check(ctx, b.pool)
	require.ErrorContains(t, err, "run `keel migrate`")
	require.NotErrorIs(t, err, migrate.ErrSchemaTooNew)
	// The old binary that stops one migration earlier is content.
	require.NoError(t, migrate.CheckWith(ctx, b.pool, oldBinary(t, 1)))
}

func TestMigrateRecordsAdditiveFlagsInADatabaseAnOlderKeelMigrated(t *testing.T) {
	b := setup(t)
	ctx := context.Background()
	// Keels before the compatibility rule recorded no flags.
	_, err := b.pool.Exec(ctx, `ALTER TABLE keel_schema_migrations DROP COLUMN additive`)
	require.NoError(t, err)
	old := oldBinary(t, 1)
	require.ErrorIs(t, migrate.CheckWith(ctx, b.pool, old), migrate.ErrSchemaTooNew,
		"without flags nothing counts as additive")
	require.NoError(t, migrate.Check(ctx, b.pool))

	res, err := migrate.Up(ctx, b.pool)
	require.NoError(t, err)
	require.Empty(t, res.Applied)
	got := recorded(t, b.pool)
	// The two newest by their numbers, which may leave a gap (a number
	// taken by work merged later).
	ms, err := migrate.All()
	require.NoError(t, err)
	require.True(t, got[ms[len(ms)-2].Version] && got[newestVersion(t)])
	require.False(t, got[1])
	require.NoError(t, migrate.CheckWith(ctx, b.pool, old))
}

// Ledgers in two schemas of one database migrate at once: a keel migrating
// one schema (holding its schema's lock and its share of the database's)
// does not hold up Up on another, while a migration of the same schema
// still waits for it.
func TestMigrationsOfTwoSchemasDoNotWaitForEachOther(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	other, _ := testenv.PrivatePool(t)
	holder, err := other.Acquire(ctx)
	require.NoError(t, err)
	defer holder.Release()
	// As Up holds them while it migrates the other schema.
	_, err = holder.Exec(ctx, `SELECT pg_advisory_lock_shared(7365434901), pg_advisory_lock(736543490, hashtext(current_schema()))`)
	require.NoError(t, err)

	cfg, err := testenv.PoolConfig(ctx, "keel_test_migrate_mine")
	require.NoError(t, err)
	mine, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(mine.Close)
	done, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	_, err = migrate.Up(done, mine)
	require.NoError(t, err, "a migration of another schema held this one's up")

	// The other schema's own Up waits for the holder.
	again, cancel2 := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel2()
	_, err = migrate.Up(again, other)
	require.ErrorIs(t, err, context.DeadlineExceeded, "two migrations of one schema ran at once")
}
