package ledger_test

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/keeljobs/keel/internal/ledger"
	"github.com/keeljobs/keel/internal/testenv"
	"github.com/keeljobs/keel/migrate"
)

// big is the ledger every plan test reads: large enough that Postgres
// prefers an index wherever one serves (see fill).
var big *pgxpool.Pool

func TestMain(m *testing.M) {
	os.Exit(run(m))
}

func run(m *testing.M) int {
	ctx := context.Background()
	// Private to this process: the tests only read it, and two runs of
	// the package at once must not drop each other's.
	schema := fmt.Sprintf("keel_test_ledger_%d", os.Getpid())
	cfg, err := testenv.PoolConfig(ctx, schema)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	big, err = pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer func() {
		big.Close()
		if conn, err := pgx.Connect(ctx, testenv.DatabaseURL()); err == nil {
			conn.Exec(ctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{schema}.Sanitize()+" CASCADE") //nolint:errcheck
			conn.Close(ctx)
		}
	}()
	if _, err := migrate.Up(ctx, big); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	if _, err := big.Exec(ctx, fill); err != nil {
		fmt.Fprintln(os.Stderr, "fill:", err)
		return 1
	}
	// As autovacuum leaves a ledger (this schema's tables only):
	// statistics, and the visibility map that index-only scans read.
	if _, err := big.Exec(ctx, "VACUUM ANALYZE keel_jobs, keel_job_deps, keel_steps, keel_batches, keel_outbox, keel_audit, keel_prune_log, keel_schedule, keel_web_sessions_ended, keel_job_progress, keel_job_results"); err != nil {
		fmt.Fprintln(os.Stderr, "vacuum:", err)
		return 1
	}
	return m.Run()
}

// fill is a ledger of 60,000 jobs in every status and shape (steps,
// batches, outbox rows, rows written unpublished, deadlines, strays, audit,
// prune log, schedule, sessions, progress, results).
const fill = `
INSERT INTO keel_batches (id, description, created_at)
SELECT 'b' || g, '', now() - g * interval '1 minute' FROM generate_series(1, 20000) g;

INSERT INTO keel_jobs (id, kind, business_key, queue, payload, max_retry, status, attempts,
	run_at, published_at, finished_at, lease_holder, lease_until, last_error, error_class,
	batch_id, deadline, in_doubt, stray_until, effects_committed_at, created_at, updated_at)
SELECT 'j' || lpad(g::text, 8, '0'), 'kind' || (g % 7), 'key' || g, (ARRAY['default', 'critical', 'low'])[1 + g % 3],
	'\x7b7d', 3, s.status, CASE WHEN s.status IN ('pending', 'running') THEN 0 ELSE 1 END,
	now() - (g % 90) * interval '1 hour', CASE WHEN g % 500 <> 7 OR s.status NOT IN ('pending', 'failed') THEN now() END,
	CASE WHEN s.status IN ('succeeded', 'dead', 'discarded', 'cancelled') THEN now() - (g % 90) * interval '1 day' END,
	CASE WHEN s.status = 'running' THEN 'worker-' || (g % 4) END,
	CASE WHEN s.status = 'running' THEN now() + interval '10 seconds' END,
	CASE WHEN s.status IN ('failed', 'dead') THEN 'boom ' || g END,
	CASE WHEN s.status IN ('failed', 'dead') THEN (ARRAY['transient', 'permanent', 'timeout', 'crashed'])[1 + g % 4] END,
	CASE WHEN g % 20 = 0 THEN 'b' || (g / 20) END,
	CASE WHEN g % 97 = 0 THEN now() + interval '1 hour' END,
	s.status = 'dead' AND g % 11 = 0,
	CASE WHEN g % 1009 = 0 THEN now() + interval '5 seconds' END,
	CASE WHEN s.status = 'dead' AND g % 13 = 0 THEN now() END,
	now() - (g % 90) * interval '1 day', now()
FROM generate_series(1, 60000) g,
	LATERAL (SELECT (ARRAY['succeeded', 'succeeded', 'succeeded', 'succeeded', 'succeeded', 'succeeded',
		'dead', 'pending', 'running', 'failed', 'discarded', 'cancelled'])[1 + g % 12] AS status) s;

-- Jobs waiting for others (a tenth of them in workflows), each on a
-- parent among the j rows.
INSERT INTO keel_jobs (id, kind, business_key, queue, payload, max_retry, status, waiting_on, published_at, run_at,
	workflow_id, workflow_task, created_at, updated_at)
SELECT 'a' || lpad(g::text, 8, '0'), 'kind' || (g % 7), 'wkey' || g, 'default', '\x7b7d', 3, 'waiting', 1, now(), now(),
	CASE WHEN g % 10 = 0 THEN 'wf' || (g / 100) END, CASE WHEN g % 10 = 0 THEN 'task' || g END,
	now() - g * interval '1 minute', now()
FROM generate_series(1, 200) g;
INSERT INTO keel_job_deps (parent_id, child_id)
SELECT 'j' || lpad((g * 7)::text, 8, '0'), 'a' || lpad(g::text, 8, '0') FROM generate_series(1, 200) g;
UPDATE keel_jobs SET has_dependents = true WHERE id IN (SELECT parent_id FROM keel_job_deps);
-- And the dependencies of jobs released long ago.
INSERT INTO keel_job_deps (parent_id, child_id)
SELECT 'j' || lpad(g::text, 8, '0'), 'j' || lpad((g + 1)::text, 8, '0') FROM generate_series(1, 30000) g;

-- Jobs of a kind with a concurrency key (limit 2): six tenants, each
-- with two running and the rest held for a slot.
INSERT INTO keel_jobs (id, kind, business_key, queue, payload, max_retry, status, published_at, run_at,
	concurrency_key, concurrency_limit, key_held_since, created_at, updated_at)
SELECT 'c' || lpad(g::text, 8, '0'), 'tenantkind', 'ckey' || g, 'default', '\x7b7d', 3,
	CASE WHEN g % 100 < 2 THEN 'running' ELSE 'waiting' END, now(), now(), 'tenant' || (g / 100), 2,
	CASE WHEN g % 100 >= 2 THEN now() - g * interval '1 second' END, now() - g * interval '1 second', now()
FROM generate_series(0, 599) g;

-- A few deaths whose alert is owed (their worker was killed first).
UPDATE keel_jobs SET alert_owed = true WHERE status = 'dead' AND id LIKE '%77';

-- Most batches are complete; one in ten is open.
UPDATE keel_batches SET sealed_at = now(),
	completed_at = CASE WHEN id NOT LIKE '%0' THEN created_at + interval '1 hour' END;

INSERT INTO keel_steps (job_id, name, status, calls, started_at, finished_at, verifiable, run)
SELECT id, 'charge', CASE WHEN status = 'succeeded' THEN 'done' ELSE 'started' END, 1, created_at,
	CASE WHEN status = 'succeeded' THEN finished_at END, id LIKE '%3', 1
FROM keel_jobs WHERE id LIKE '%0' OR id LIKE '%3';

INSERT INTO keel_outbox (job_id, queued_at)
SELECT id, now() - interval '1 second' FROM keel_jobs WHERE published_at IS NOT NULL AND status = 'pending' LIMIT 500;

INSERT INTO keel_audit (job_id, action, actor, note)
SELECT id, 'replay', 'ops', 'checked' FROM keel_jobs WHERE status = 'dead' LIMIT 2000;

INSERT INTO keel_prune_log (at, rows) SELECT now() - g * interval '1 hour', 1000 FROM generate_series(1, 500) g;

INSERT INTO keel_schedule (entry, last_tick)
SELECT 'entry' || g, now() - g * interval '1 minute' FROM generate_series(1, 2000) g;

INSERT INTO keel_web_sessions_ended (session_id, expires_at)
SELECT 's' || g, now() + (g % 50 - 1) * interval '1 hour' FROM generate_series(1, 5000) g;

-- Progress of every running job and of one in three others; a result for
-- one succeeded job in three.
INSERT INTO keel_job_progress (job_id, run, done, total, note)
SELECT id, 1, 5, 10, 'half' FROM keel_jobs WHERE status = 'running' OR id LIKE '%3' OR id LIKE '%6' OR id LIKE '%9';
INSERT INTO keel_job_results (job_id, result)
SELECT id, '{"ok": true}' FROM keel_jobs WHERE status = 'succeeded' AND (id LIKE '%1' OR id LIKE '%4' OR id LIKE '%7');

`

// plan returns Postgres's plan, on the big ledger, for the first statement
// call sends through the DB it is given.
func plan(t *testing.T, call func(db ledger.DB)) string {
	t.Helper()
	sql, args := ledger.Statement(call)
	if sql == "" {
		t.Fatal("plan: the function sent no statement")
	}
	rows, err := big.Query(context.Background(), "EXPLAIN "+sql, args...)
	if err != nil {
		t.Fatalf("plan: EXPLAIN %s: %v", sql, err)
	}
	lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatalf("plan: EXPLAIN %s: %v", sql, err)
	}
	return strings.Join(lines, "\n")
}

// usesIndex fails unless the plan reads each of indexes and scans none of
// tables whole.
func usesIndex(t *testing.T, p string, indexes []string, noSeqScan ...string) {
	t.Helper()
	for _, ix := range indexes {
		if !strings.Contains(p, ix) {
			t.Errorf("plan does not use %s:\n%s", ix, p)
		}
	}
	for _, tbl := range noSeqScan {
		if strings.Contains(p, "Seq Scan on "+tbl) {
			t.Errorf("plan scans %s whole:\n%s", tbl, p)
		}
	}
}

// lacks fails if the plan mentions any of words (a node, an index).
func lacks(t *testing.T, p string, words ...string) {
	t.Helper()
	for _, w := range words {
		if strings.Contains(p, w) {
			t.Errorf("plan has %s:\n%s", w, p)
		}
	}
}
