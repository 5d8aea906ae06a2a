package budget_test

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"os"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/internal/ledger"
	"github.com/keeljobs/keel/internal/testenv"
	"github.com/keeljobs/keel/migrate"
	"github.com/keeljobs/keel/server"
	"github.com/keeljobs/keel/tasks"
)

// statementsEnv turns TestPerStatementCost on. It is off by default: it
// asserts nothing the budget test does not, and CI need not pay for it.
const statementsEnv = "KEEL_COST_STATEMENTS"

// The measured pools connect as these roles, so that pg_stat_statements
// tells their statements apart, and from the test's own reads.
const (
	workerRole   = "keel_worker"
	producerRole = "keel_producer"
)

// slowKind's handler takes slowJob, so that its lease is renewed about
// slowJob / (DefaultLease / 5) times: what renewals cost shows. Few jobs,
// one or two waves of the default concurrency.
var slowKind = tasks.Define[noop]("budget:slow", tasks.Key(func(p noop) string { return fmt.Sprint(p.N) }))

const (
	slowJob  = 5 * time.Second
	slowJobs = 40
)

// e2eKind is the exactly-once path end to end: EnqueueTx, the relay, and a
// worker whose handler writes through InTx. A kind of its own, so its keys
// do not meet the InTx scenario's on the shared ledger.
var e2eKind = tasks.Define[noop]("budget:e2e", tasks.Key(func(p noop) string { return fmt.Sprint(p.N) }))

// TestPerStatementCost shows where a job's cost goes: for each scenario,
// per job, every statement the worker or producer ran (pg_stat_statements:
// calls, rows, buffers, WAL), every table's row changes
// (pg_stat_user_tables), and the WAL itself, record by record
// (pg_walinspect), which names the index each entry went to: a partial
// index whose predicate leaves a row out gets none. It prints markdown for
// BENCHMARKS.md §13 and asserts only that its sources agree.
//
//	KEEL_COST_STATEMENTS=1 go test -run TestPerStatementCost -v ./internal/budget/
func TestPerStatementCost(t *testing.T) {
	if os.Getenv(statementsEnv) == "" {
		t.Skipf("set %s=1 to break a job's cost down by statement (BENCHMARKS.md §13)", statementsEnv)
	}
	b := newStmtBench(t)
	var all []stmtRun
	for _, k := range []struct {
		name, short string
		kind        *tasks.Kind[noop]
		jobs        int
	}{
		{"process no-op", "no-op", noopKind, jobsPerRun},
		{"process InTx", "InTx", inTxKind, jobsPerRun},
		{"process Step + InTx", "Step + InTx", stepKind, jobsPerRun},
		{fmt.Sprintf("process no-op, %s a job", slowJob), fmt.Sprintf("no-op, %s", slowJob), slowKind, slowJobs},
	} {
		all = append(all, b.process(t, k.name, k.kind, k.jobs).named(k.short))
	}
	// Before the enqueue scenarios: their jobs, in Redis and on the outbox,
	// would be this worker's and relay's too.
	all = append(all, b.endToEnd(t).named("EnqueueTx → InTx"))
	for _, how := range []struct{ name, short string }{
		{"enqueue one by one", "Enqueue"}, {"enqueue in bulk", "EnqueueMany"}, {"EnqueueTx, 1 a tx", "EnqueueTx"},
	} {
		all = append(all, b.enqueue(t, how.name).named(how.short))
	}
	t.Logf("\n%s\n%s\n%s", summaryTable(all), walTable(all), b.indexTable(all))
	for _, r := range all {
		t.Logf("\n%s", r.markdown())
	}
}

// stmtBench is a private Postgres with pg_stat_statements (nested
// statements too) and pg_walinspect, and a private Redis.
type stmtBench struct {
	pg      *testenv.PostgresServer
	redis   asynq.RedisClientOpt
	obs     *pgx.Conn // the test's own reads; it writes nothing while a scenario runs
	known   []knownStatement
	indexes []indexInfo
}

type indexInfo struct {
	table, name, predicate string
}

func newStmtBench(t *testing.T) *stmtBench {
	pg := testenv.StartPostgres(t, "shared_preload_libraries=pg_stat_statements", "pg_stat_statements.track=all")
	rs := testenv.StartRedis(t)
	ctx := context.Background()
	b := &stmtBench{pg: pg, redis: asynq.RedisClientOpt{Addr: rs.Addr()}, known: knownStatements()}
	setup := b.pool(t, "postgres", nil)
	_, err := migrate.Up(ctx, setup)
	require.NoError(t, err)
	for _, sql := range []string{
		`CREATE EXTENSION pg_stat_statements`,
		`CREATE EXTENSION pg_walinspect`,
		`CREATE TABLE effects (job_id text PRIMARY KEY)`,
		// Superusers: what they may do is not what is measured.
		`CREATE ROLE ` + workerRole + ` LOGIN SUPERUSER`,
		`CREATE ROLE ` + producerRole + ` LOGIN SUPERUSER`,
	} {
		_, err := setup.Exec(ctx, sql)
		require.NoError(t, err, sql)
	}
	setup.Close()
	b.obs, err = pgx.Connect(ctx, pg.URL(""))
	require.NoError(t, err)
	t.Cleanup(func() { b.obs.Close(context.Background()) })
	rows, err := b.obs.Query(ctx, `SELECT c.relname, i.relname, coalesce(pg_get_expr(x.indpred, x.indrelid), '')
		FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid JOIN pg_class c ON c.oid = x.indrelid
		WHERE c.relnamespace = 'public'::regnamespace ORDER BY 1, 2`)
	require.NoError(t, err)
	for rows.Next() {
		var ix indexInfo
		require.NoError(t, rows.Scan(&ix.table, &ix.name, &ix.predicate))
		b.indexes = append(b.indexes, ix)
	}
	require.NoError(t, rows.Err())
	return b
}

// pool connects as role, through tr when it is not nil.
func (b *stmtBench) pool(t *testing.T, role string, tr pgx.QueryTracer) *pgxpool.Pool {
	cfg, err := pgxpool.ParseConfig(b.pg.URL(""))
	require.NoError(t, err)
	cfg.ConnConfig.User = role
	cfg.MaxConns = 20
	cfg.ConnConfig.Tracer = tr
	p, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(p.Close)
	return p
}

// settle waits until every other session has ended. A backend sends its
// table counters to pg_stat_user_tables at most once a second while it
// lives, and for good when it exits; closed pools and gone sessions leave
// nothing pending.
func (b *stmtBench) settle(t *testing.T) {
	ctx := context.Background()
	testenv.Eventually(t, 30*time.Second, func() bool {
		var n int
		require.NoError(t, b.obs.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()`).Scan(&n))
		return n == 0
	}, "sessions still open")
}

// begin resets the statistics once nothing else runs and returns where
// the WAL stands: its insert position; pg_current_wal_lsn is where it was
// written out to, which lags behind with synchronous_commit off.
func (b *stmtBench) begin(t *testing.T) string {
	b.settle(t)
	ctx := context.Background()
	_, err := b.obs.Exec(ctx, `SELECT pg_stat_statements_reset(), pg_stat_reset()`)
	require.NoError(t, err)
	var lsn string
	require.NoError(t, b.obs.QueryRow(ctx, `SELECT pg_current_wal_insert_lsn()::text`).Scan(&lsn))
	return lsn
}

// stmtRun is what one scenario cost, in totals over its jobs.
type stmtRun struct {
	name, short  string
	jobs         int
	trips        float64 // round trips (pgx), own and shared, as TestPerJobCost counts them
	shared       float64
	statements   []stmtLine
	tables       []tableLine
	wal          []walLine
	walLSN       float64          // bytes between the two LSNs: records, their alignment and page headers
	indexEntries map[string]int64 // by index name, from the WAL
}

type stmtLine struct {
	label, by                 string
	nested                    bool
	calls, rows, hit, dirtied int64
	walRecords                int64
	walBytes                  float64
}

type tableLine struct {
	name               string
	ins, upd, hot, del int64
	indexes            int
	entries            int64 // index entries written, from the WAL
}

type walLine struct {
	rel, rmgr, kind string
	count           int64
	bytes           int64
}

// collect waits for the scenario's sessions to end and reads what they
// cost since lsn0.
func (b *stmtBench) collect(t *testing.T, name string, jobs int, lsn0 string, trips, shared int64) stmtRun {
	b.settle(t)
	ctx := context.Background()
	r := stmtRun{name: name, jobs: jobs, trips: float64(trips), shared: float64(shared), indexEntries: map[string]int64{}}
	var lsn1 string
	require.NoError(t, b.obs.QueryRow(ctx, `SELECT pg_current_wal_insert_lsn()::text, pg_wal_lsn_diff(pg_current_wal_insert_lsn(), $1::pg_lsn)`,
		lsn0).Scan(&lsn1, &r.walLSN))
	// pg_walinspect reads only what is flushed; with synchronous_commit
	// off the WAL writer flushes within a fraction of a second.
	testenv.Eventually(t, 30*time.Second, func() bool {
		var ok bool
		require.NoError(t, b.obs.QueryRow(ctx, `SELECT pg_current_wal_flush_lsn() >= $1::pg_lsn`, lsn1).Scan(&ok))
		return ok
	}, "WAL not flushed")

	names := map[uint32]string{}
	rows, err := b.obs.Query(ctx, `SELECT pg_relation_filenode(oid)::oid, relname FROM pg_class WHERE pg_relation_filenode(oid) IS NOT NULL`)
	require.NoError(t, err)
	for rows.Next() {
		var node uint32
		var rel string
		require.NoError(t, rows.Scan(&node, &rel))
		names[node] = rel
	}
	require.NoError(t, rows.Err())

	// An index entry is a leaf insert: INSERT_LEAF, INSERT_POST (into a
	// posting list), or a leaf split, whose record carries the new item.
	heap := map[string]*tableLine{}
	rows, err = b.obs.Query(ctx, `SELECT resource_manager,
			CASE WHEN record_type = 'LOCK' THEN 'LOCK ' || regexp_replace(description, '^.*flags 0x[0-9A-Fa-f]+ *', '')
				ELSE split_part(record_type, '+', 1) END,
			coalesce(substring(block_ref from 'rel \d+/\d+/(\d+)')::oid, 0), count(*), sum(record_length),
			count(*) FILTER (WHERE record_type IN ('INSERT_LEAF', 'INSERT_POST')
				OR (record_type IN ('SPLIT_L', 'SPLIT_R') AND description ~ 'level:? 0,'))
		FROM pg_get_wal_records_info($1::pg_lsn, $2::pg_lsn) GROUP BY 1, 2, 3`, lsn0, lsn1)
	require.NoError(t, err)
	for rows.Next() {
		var w walLine
		var node uint32
		var entries int64
		require.NoError(t, rows.Scan(&w.rmgr, &w.kind, &node, &w.count, &w.bytes, &entries))
		w.kind = lockKind(w.kind)
		w.rel = names[node]
		if w.rel == "" && node != 0 {
			w.rel = fmt.Sprintf("relfilenode %d", node)
		}
		r.wal = append(r.wal, w)
		if entries > 0 {
			r.indexEntries[w.rel] += entries
		}
		if w.rmgr == "Heap" {
			tl := heap[w.rel]
			if tl == nil {
				tl = &tableLine{name: w.rel}
				heap[w.rel] = tl
			}
			switch w.kind {
			case "INSERT":
				tl.ins += w.count
			case "UPDATE":
				tl.upd += w.count
			case "HOT_UPDATE":
				tl.upd += w.count
				tl.hot += w.count
			case "DELETE":
				tl.del += w.count
			}
		}
	}
	require.NoError(t, rows.Err())

	// The table counters must say what the WAL says: then every session's
	// counters are in.
	var stats []tableLine
	var differ string
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		stats, differ = b.tableStats(t), ""
		for _, s := range stats {
			w := heap[s.name]
			if w == nil {
				w = &tableLine{}
			}
			if s.ins != w.ins || s.upd != w.upd || s.hot != w.hot || s.del != w.del {
				differ += fmt.Sprintf("\n%s: pg_stat_user_tables %d/%d/%d/%d, WAL %d/%d/%d/%d (inserts/updates/HOT/deletes)",
					s.name, s.ins, s.upd, s.hot, s.del, w.ins, w.upd, w.hot, w.del)
			}
		}
		if differ == "" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("pg_stat_user_tables does not agree with the WAL:%s", differ)
		}
	}
	for _, s := range stats {
		if s.ins+s.upd+s.del == 0 {
			continue
		}
		for _, ix := range b.indexes {
			if ix.table == s.name {
				s.indexes++
				s.entries += r.indexEntries[ix.name]
			}
		}
		r.tables = append(r.tables, s)
	}

	r.statements = b.statements(t)
	return r
}

// lockKind names a row lock's WAL record by the lock its bits make: FOR
// UPDATE, or a foreign key's FOR KEY SHARE. An UPDATE whose new version
// goes to another page first locks the old one too, with the strongest
// lock its transaction holds on the row: FOR NO KEY UPDATE, or FOR UPDATE
// after the claim's own.
func lockKind(kind string) string {
	if !strings.HasPrefix(kind, "LOCK ") {
		return kind
	}
	bits := strings.Fields(strings.TrimPrefix(kind, "LOCK "))
	switch {
	case slices.Contains(bits, "KEYSHR_LOCK"):
		return "LOCK (FOR KEY SHARE)"
	case slices.Contains(bits, "EXCL_LOCK") && slices.Contains(bits, "KEYS_UPDATED"):
		return "LOCK (FOR UPDATE)"
	case slices.Contains(bits, "EXCL_LOCK"):
		return "LOCK (FOR NO KEY UPDATE)"
	}
	return kind
}

// tableStats reads the row changes of every user table.
func (b *stmtBench) tableStats(t *testing.T) []tableLine {
	rows, err := b.obs.Query(context.Background(), `SELECT relname, n_tup_ins, n_tup_upd, n_tup_hot_upd, n_tup_del
		FROM pg_stat_user_tables ORDER BY relname`)
	require.NoError(t, err)
	var out []tableLine
	for rows.Next() {
		var s tableLine
		require.NoError(t, rows.Scan(&s.name, &s.ins, &s.upd, &s.hot, &s.del))
		out = append(out, s)
	}
	require.NoError(t, rows.Err())
	return out
}

// statements reads pg_stat_statements for the measured roles, under the
// labels of the statements keel runs.
func (b *stmtBench) statements(t *testing.T) []stmtLine {
	rows, err := b.obs.Query(context.Background(), `SELECT r.rolname, s.toplevel, s.query, s.calls, s.rows,
			s.shared_blks_hit, s.shared_blks_dirtied, s.wal_records, s.wal_bytes::float8
		FROM pg_stat_statements s JOIN pg_roles r ON r.oid = s.userid WHERE r.rolname = ANY ($1)`,
		[]string{workerRole, producerRole})
	require.NoError(t, err)
	byLabel := map[string]*stmtLine{}
	for rows.Next() {
		var role, query string
		var top bool
		var l stmtLine
		require.NoError(t, rows.Scan(&role, &top, &query, &l.calls, &l.rows, &l.hit, &l.dirtied, &l.walRecords, &l.walBytes))
		l.label, l.by, l.nested = b.label(query), strings.TrimPrefix(role, "keel_"), !top
		key := fmt.Sprint(l.label, l.by, l.nested)
		if s := byLabel[key]; s != nil {
			s.calls, s.rows, s.hit, s.dirtied = s.calls+l.calls, s.rows+l.rows, s.hit+l.hit, s.dirtied+l.dirtied
			s.walRecords, s.walBytes = s.walRecords+l.walRecords, s.walBytes+l.walBytes
			continue
		}
		byLabel[key] = &l
	}
	require.NoError(t, rows.Err())
	var out []stmtLine
	for _, l := range byLabel {
		out = append(out, *l)
	}
	slices.SortFunc(out, func(a, b stmtLine) int {
		return cmp.Or(cmp.Compare(b.walBytes, a.walBytes), cmp.Compare(b.calls, a.calls), cmp.Compare(a.label, b.label))
	})
	return out
}

// knownStatement is a statement keel runs and the label it goes by here.
type knownStatement struct {
	label, fingerprint string
}

// knownStatements takes the ledger's statements from the ledger itself
// (ledger.Statement), so a change to one keeps its label.
func knownStatements() []knownStatement {
	ctx := context.Background()
	of := func(call func(db ledger.DB)) string {
		sql, _ := ledger.Statement(call)
		return sql
	}
	batched := func(call func(b ledger.Batcher)) func(ledger.DB) {
		return func(db ledger.DB) { call(db.(ledger.Batcher)) }
	}
	list := []struct{ label, sql string }{
		{"claim + completion round", of(func(db ledger.DB) { _ = ledger.Round(ctx, db, ledger.RoundArgs{}, nil) })},
		{"claim + completion round, batch members", of(func(db ledger.DB) { _ = ledger.Round(ctx, db, ledger.RoundArgs{Batch: true}, nil) })},
		{"why claims did not take", of(func(db ledger.DB) { _ = ledger.ReadUnclaimed(ctx, db, nil, nil) })},
		{"lease renewal", of(func(db ledger.DB) { _, _ = ledger.Renew(ctx, db, "", 0, nil, nil) })},
		{"completion mark + COMMIT (InTx)", of(batched(func(b ledger.Batcher) { _ = ledger.MarkSucceededAndCommit(ctx, b, "", "", 0, nil) }))},
		{"progress write", of(func(db ledger.DB) { _, _ = ledger.WriteProgress(ctx, db, "", "", 0, 0, 0, "") })},
		{"completion + result (no InTx)", of(func(db ledger.DB) { _ = ledger.CompleteWithResult(ctx, db, "", "", 0, nil) })},
		{"result store (InTx)", of(batched(func(b ledger.Batcher) { _ = ledger.MarkSucceededAndCommit(ctx, b, "", "", 0, []byte(`{}`)) }))},
		{"step started insert", of(func(db ledger.DB) { _, _, _ = ledger.StartStep(ctx, db, ledger.StepRun{}, false, 0) })},
		{"step done update", of(func(db ledger.DB) { _, _ = ledger.StepDone(ctx, db, ledger.StepRun{}, nil) })},
		{"step calls in flight renewal", of(func(db ledger.DB) { _ = ledger.RenewFlights(ctx, db, "", 0, nil, nil, nil) })},
		{"insert, bulk (Enqueue's group commit, EnqueueMany)", of(func(db ledger.DB) {
			_ = ledger.InsertJobs(ctx, db, ledger.JobRows{}, false, false, nil, nil)
		})},
		{"insert + outbox + wake (EnqueueTx)", of(func(db ledger.DB) { _, _ = ledger.InsertJob(ctx, db, ledger.JobInsert{}, true) })},
		{"insert, one row", of(func(db ledger.DB) { _, _ = ledger.InsertJob(ctx, db, ledger.JobInsert{}, false) })},
		{"relay: outbox empty?", of(func(db ledger.DB) { _, _ = ledger.OutboxDue(ctx, db) })},
		{"relay claim (outbox delete + job read)", of(func(db ledger.DB) { _, _, _ = ledger.ClaimOutbox(ctx, db, 0, 0, nil) })},
		{"relay claim of rows written unpublished", of(func(db ledger.DB) { _, _ = ledger.ClaimUnpublished(ctx, db, 0, nil) })},
		{"relay: try awake/settle lock", of(func(db ledger.DB) { _, _ = ledger.TryRelayLock(ctx, db, ledger.RelayAwakeLock) })},
		{"relay: unlock awake/settle lock", of(func(db ledger.DB) { _, _ = ledger.UnlockRelay(ctx, db, ledger.RelayAwakeLock) })},
		{"relay: wait for the awake lock", of(func(db ledger.DB) { _ = ledger.LockRelayAwake(ctx, db) })},
		{"relay: another relay awake?", of(func(db ledger.DB) { _, _ = ledger.RelayAwakeHeld(ctx, db) })},
		{"relay: LISTEN", of(func(db ledger.DB) { _ = ledger.ListenRelay(ctx, db) })},
		{"relay: mark published", of(func(db ledger.DB) { _ = ledger.MarkPublished(ctx, db, nil) })},
		{"relay: hand back unpublished", of(func(db ledger.DB) { _ = ledger.Unpublish(ctx, db, nil) })},
		{"relay backlog gauge", of(func(db ledger.DB) { _, _, _ = ledger.RelayBacklog(ctx, db, nil) })},
		{"settle: finished among", of(func(db ledger.DB) { _, _ = ledger.FinishedAmong(ctx, db, nil) })},
		{"reconcile: pass lock", of(func(db ledger.DB) { _, _ = ledger.TryReconcileLock(ctx, db) })},
		{"reconcile: unlock", of(func(db ledger.DB) { _ = ledger.ReconcileUnlock(ctx, db) })},
		{"reconcile page", of(func(db ledger.DB) { _, _ = ledger.ReconcilePage(ctx, db, 0, "", 0, nil) })},
		{"rescue page", of(func(db ledger.DB) { _, _ = ledger.RescuePage(ctx, db, "", 0, nil) })},
		{"stray marks", of(func(db ledger.DB) { _ = ledger.MarkStrays(ctx, db, nil, 0) })},
		{"failure record", of(func(db ledger.DB) { _, _, _ = ledger.Fail(ctx, db, ledger.Failure{}) })},
		{"release (run interrupted)", of(func(db ledger.DB) { _ = ledger.Release(ctx, db, "", "", 0) })},
		{"prune finished jobs", of(func(db ledger.DB) { _, _ = ledger.PruneKind(ctx, db, "", "", 0, 0, nil) })},
		{"prune completed batches", of(func(db ledger.DB) { _, _ = ledger.PruneBatches(ctx, db, 0, 0, nil) })},
		{"BEGIN", "begin"},
		// Under-counted: Postgres 15's pg_stat_statements counts a prepared
		// utility statement at its first run only, and pgx prepares the
		// COMMIT it pipelines behind the completion mark once a connection.
		// The WAL's commit records count every one.
		{"COMMIT", "commit"},
		{"handler's own INSERT (effects)", `INSERT INTO effects (job_id) VALUES ($1)`},
		{"relay: SET lock_timeout", `SET lock_timeout = 20`},
	}
	out := make([]knownStatement, 0, len(list))
	for _, k := range list {
		out = append(out, knownStatement{k.label, fingerprint(k.sql)})
	}
	return out
}

var (
	fpLiteral = regexp.MustCompile(`'(?:[^']|'')*'|\$\d+|\b\d+(?:\.\d+)?\b|\b(?:null|true|false)\b`)
	fpNegate  = regexp.MustCompile(`([=(,\s])-\s*\?`)
	fpSpace   = regexp.MustCompile(`\s+`)
)

// fingerprint makes a statement's text comparable with what
// pg_stat_statements keeps of it, which replaces constants with $n: every
// constant and parameter becomes ?, and white space one space.
func fingerprint(sql string) string {
	s := fpLiteral.ReplaceAllString(strings.ToLower(sql), "?")
	s = fpNegate.ReplaceAllString(s, "$1?")
	return strings.TrimSuffix(strings.TrimSpace(fpSpace.ReplaceAllString(s, " ")), ";")
}

// label names query by the keel statement it is, or shortens its text.
func (b *stmtBench) label(query string) string {
	fp := fingerprint(query)
	for _, k := range b.known {
		if k.fingerprint == fp {
			return k.label
		}
	}
	// The migrate package's statement is not the ledger's to hand out.
	if strings.HasPrefix(fp, "select version, coalesce((to_jsonb(m)") {
		return "server start: schema check"
	}
	s := fpSpace.ReplaceAllString(strings.TrimSpace(query), " ")
	if len(s) > 60 {
		s = s[:60] + "…"
	}
	return "`" + strings.ReplaceAll(s, "|", `\|`) + "`"
}

// warnings keeps a worker's log to what went wrong: 600 "job done" lines
// a scenario would bury the tables.
var warnings = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))

// stmtMux is mux with the end-to-end and the slow kinds.
func stmtMux() *tasks.Mux {
	m := mux()
	tasks.Handle(m, e2eKind, func(ctx context.Context, _ noop) error { return effect(ctx) })
	tasks.Handle(m, slowKind, func(ctx context.Context, _ noop) error {
		select {
		case <-time.After(slowJob):
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	})
	return m
}

// process measures a worker with the defaults (no relay, no reconciler,
// as TestPerJobCost) processing jobs jobs of kind, enqueued in bulk before
// the statistics are reset.
func (b *stmtBench) process(t *testing.T, name string, kind *tasks.Kind[noop], jobs int) stmtRun {
	ctx := context.Background()
	setup := b.pool(t, "postgres", nil)
	client, err := tasks.NewClient(tasks.ClientConfig{Redis: b.redis, Pool: setup})
	require.NoError(t, err)
	ts := make([]*tasks.Task, jobs)
	for i := range ts {
		ts[i] = kind.New(noop{N: i})
	}
	_, err = client.EnqueueMany(ctx, ts...)
	require.NoError(t, err)
	require.NoError(t, client.Close())
	setup.Close()

	lsn := b.begin(t)
	trips := &pgCounter{}
	work := b.pool(t, workerRole, trips)
	srv, err := server.New(server.Config{Redis: b.redis, Pool: work, DisableReconciler: true, DisableRelay: true,
		Logger: warnings}, stmtMux())
	require.NoError(t, err)
	b.runUntilDone(t, srv, jobs, nil)
	work.Close()
	return b.collect(t, name, jobs, lsn, trips.trips.Load(), trips.shared.Load())
}

// runUntilDone runs srv until its guard has recorded jobs successes,
// while produce (if not nil) runs beside it.
func (b *stmtBench) runUntilDone(t *testing.T, srv *server.Server, jobs int, produce func()) {
	runCtx, stop := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() { require.NoError(t, srv.Run(runCtx)) })
	if produce != nil {
		produce()
	}
	testenv.Eventually(t, 2*time.Minute, func() bool { return srv.GuardStats().Succeeded >= uint64(jobs) },
		"the jobs did not all succeed")
	stop()
	wg.Wait()
}

// enqueue measures a producer alone, as TestPerJobCost does.
func (b *stmtBench) enqueue(t *testing.T, how string) stmtRun {
	ctx := context.Background()
	lsn := b.begin(t)
	trips := &pgCounter{}
	prod := b.pool(t, producerRole, trips)
	client, err := tasks.NewClient(tasks.ClientConfig{Redis: b.redis, Pool: prod})
	require.NoError(t, err)
	offset := map[string]int{"enqueue one by one": 0, "enqueue in bulk": 1, "EnqueueTx, 1 a tx": 2}[how] * jobsPerRun
	switch how {
	case "enqueue one by one":
		for i := range jobsPerRun {
			_, err := client.Enqueue(ctx, enqueueKd.New(noop{N: offset + i}))
			require.NoError(t, err)
		}
	case "enqueue in bulk":
		ts := make([]*tasks.Task, jobsPerRun)
		for i := range ts {
			ts[i] = enqueueKd.New(noop{N: offset + i})
		}
		_, err := client.EnqueueMany(ctx, ts...)
		require.NoError(t, err)
	case "EnqueueTx, 1 a tx":
		for i := range jobsPerRun {
			require.NoError(t, pgx.BeginFunc(ctx, prod, func(tx pgx.Tx) error {
				_, err := client.EnqueueTx(ctx, tx, enqueueKd.New(noop{N: offset + i}))
				return err
			}))
		}
	}
	require.NoError(t, client.Close())
	prod.Close()
	return b.collect(t, how, jobsPerRun, lsn, trips.trips.Load(), trips.shared.Load())
}

// endToEnd measures the exactly-once path whole: a producer's EnqueueTx,
// one job a transaction, and a worker with the defaults (relay and
// reconciler on) whose handler writes through InTx.
func (b *stmtBench) endToEnd(t *testing.T) stmtRun {
	ctx := context.Background()
	lsn := b.begin(t)
	prodTrips, workTrips := &pgCounter{}, &pgCounter{}
	prod := b.pool(t, producerRole, prodTrips)
	work := b.pool(t, workerRole, workTrips)
	client, err := tasks.NewClient(tasks.ClientConfig{Redis: b.redis, Pool: prod})
	require.NoError(t, err)
	srv, err := server.New(server.Config{Redis: b.redis, Pool: work, Logger: warnings}, stmtMux())
	require.NoError(t, err)
	b.runUntilDone(t, srv, jobsPerRun, func() {
		for i := range jobsPerRun {
			require.NoError(t, pgx.BeginFunc(ctx, prod, func(tx pgx.Tx) error {
				_, err := client.EnqueueTx(ctx, tx, e2eKind.New(noop{N: i}))
				return err
			}))
		}
	})
	require.NoError(t, client.Close())
	prod.Close()
	work.Close()
	return b.collect(t, "EnqueueTx → relay → process InTx (relay and reconciler on)", jobsPerRun, lsn,
		prodTrips.trips.Load()+workTrips.trips.Load(), prodTrips.shared.Load()+workTrips.shared.Load())
}

// named sets the scenario's short name, for the tables' columns.
func (r stmtRun) named(short string) stmtRun {
	r.short = short
	return r
}

// per formats a total as an amount per job.
func (r stmtRun) per(n float64) string {
	v := n / float64(r.jobs)
	switch {
	case v == 0:
		return "0"
	case v < 0.01:
		return fmt.Sprintf("%.3f", v)
	case v < 100:
		return fmt.Sprintf("%.2f", v)
	default:
		return fmt.Sprintf("%.0f", v)
	}
}

// total adds up what the top-level statements did (nested ones are in
// their callers' figures already).
func (r stmtRun) total() stmtLine {
	var t stmtLine
	for _, s := range r.statements {
		if !s.nested {
			t.calls, t.rows, t.hit, t.dirtied = t.calls+s.calls, t.rows+s.rows, t.hit+s.hit, t.dirtied+s.dirtied
			t.walRecords, t.walBytes = t.walRecords+s.walRecords, t.walBytes+s.walBytes
		}
	}
	return t
}

// walSum is the scenario's WAL records of kinds that match.
func (r stmtRun) walSum(match func(walLine) bool) (count, bytes float64) {
	for _, w := range r.wal {
		if match(w) {
			count, bytes = count+float64(w.count), bytes+float64(w.bytes)
		}
	}
	return count, bytes
}

// minor bounds what a scenario's statement table shows on a line of its
// own: less than this many calls a job, and no WAL, is start-up and upkeep.
const minor = 0.01

func (r stmtRun) markdown() string {
	var sb strings.Builder
	f := func(format string, args ...any) { fmt.Fprintf(&sb, format, args...) }
	f("#### %s\n\n", r.name)
	f("Per job (%d jobs): %s round trips of its own + %s shared (rounds, renewals); %s WAL bytes from LSN to LSN.\n\n",
		r.jobs, r.per(r.trips), r.per(r.shared), r.per(r.walLSN))
	f("| statement | by | calls | rows | buffers hit | dirtied | WAL records | WAL bytes |\n|---|---|---:|---:|---:|---:|---:|---:|\n")
	var rest stmtLine
	restN := 0
	for _, s := range r.statements {
		label := s.label
		if s.nested {
			label = "↳ " + label + " (nested, counted in its caller)"
		} else if float64(s.calls)/float64(r.jobs) < minor && s.walBytes == 0 {
			rest.calls, rest.rows, rest.hit, rest.dirtied = rest.calls+s.calls, rest.rows+s.rows, rest.hit+s.hit, rest.dirtied+s.dirtied
			restN++
			continue
		}
		f("| %s | %s | %s | %s | %s | %s | %s | %s |\n", label, s.by, r.per(float64(s.calls)), r.per(float64(s.rows)),
			r.per(float64(s.hit)), r.per(float64(s.dirtied)), r.per(float64(s.walRecords)), r.per(s.walBytes))
	}
	if restN > 0 {
		f("| %d more, each under %.2f a job and writing no WAL (start-up, upkeep) | | %s | %s | %s | %s | 0 | 0 |\n", restN, minor,
			r.per(float64(rest.calls)), r.per(float64(rest.rows)), r.per(float64(rest.hit)), r.per(float64(rest.dirtied)))
	}
	t := r.total()
	f("| **all statements** | | %s | %s | %s | %s | %s | %s |\n", r.per(float64(t.calls)), r.per(float64(t.rows)),
		r.per(float64(t.hit)), r.per(float64(t.dirtied)), r.per(float64(t.walRecords)), r.per(t.walBytes))
	recs, bytes := r.walSum(func(walLine) bool { return true })
	f("| WAL outside statements (commit records, background) | | | | | | %s | %s |\n\n",
		r.per(recs-float64(t.walRecords)), r.per(bytes-t.walBytes))

	f("| table | inserts | updates | of them HOT | deletes | indexes | (ins + non-HOT upd) × indexes | index entries written (WAL) |\n|---|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, s := range r.tables {
		f("| %s | %s | %s | %s | %s | %d | %s | %s |\n", s.name, r.per(float64(s.ins)), r.per(float64(s.upd)), r.per(float64(s.hot)),
			r.per(float64(s.del)), s.indexes, r.per(float64((s.ins+s.upd-s.hot)*int64(s.indexes))), r.per(float64(s.entries)))
	}
	f("\n| WAL record | relation | records | bytes |\n|---|---|---:|---:|\n")
	wal := slices.Clone(r.wal)
	slices.SortFunc(wal, func(a, b walLine) int { return cmp.Or(cmp.Compare(b.bytes, a.bytes), cmp.Compare(a.rel, b.rel)) })
	for _, w := range wal {
		if float64(w.count)/float64(r.jobs) < 0.005 {
			continue
		}
		f("| %s %s | %s | %s | %s |\n", w.rmgr, w.kind, w.rel, r.per(float64(w.count)), r.per(float64(w.bytes)))
	}
	f("| (records under 0.005 a job left out; sum of all) | | %s | %s |\n", r.per(recs), r.per(bytes))
	return sb.String()
}

// header is a table's first two lines: first, then a column a scenario.
func header(first string, runs []stmtRun) string {
	var sb strings.Builder
	sb.WriteString("| " + first + " |")
	for _, r := range runs {
		sb.WriteString(" " + r.short + " |")
	}
	sb.WriteString("\n|---|" + strings.Repeat("---:|", len(runs)) + "\n")
	return sb.String()
}

// summaryTable is what each scenario cost a job, in a line each.
func summaryTable(runs []stmtRun) string {
	var sb strings.Builder
	sb.WriteString(header("per job", runs))
	row := func(name string, v func(r stmtRun) string) {
		sb.WriteString("| " + name + " |")
		for _, r := range runs {
			sb.WriteString(" " + v(r) + " |")
		}
		sb.WriteString("\n")
	}
	count := func(match func(walLine) bool) func(r stmtRun) string {
		return func(r stmtRun) string {
			n, _ := r.walSum(match)
			return r.per(n)
		}
	}
	row("jobs measured", func(r stmtRun) string { return fmt.Sprint(r.jobs) })
	row("round trips, own", func(r stmtRun) string { return r.per(r.trips) })
	row("round trips, shared (rounds, renewals)", func(r stmtRun) string { return r.per(r.shared) })
	row("statements (pg_stat_statements calls)", func(r stmtRun) string { return r.per(float64(r.total().calls)) })
	row("shared buffers hit", func(r stmtRun) string { return r.per(float64(r.total().hit)) })
	row("row versions written (heap inserts + updates)", count(func(w walLine) bool {
		return w.rmgr == "Heap" && (w.kind == "INSERT" || w.kind == "UPDATE" || w.kind == "HOT_UPDATE")
	}))
	row("of them HOT", count(func(w walLine) bool { return w.rmgr == "Heap" && w.kind == "HOT_UPDATE" }))
	row("index entries written", func(r stmtRun) string {
		var n int64
		for _, e := range r.indexEntries {
			n += e
		}
		return r.per(float64(n))
	})
	row("row locks written (Heap LOCK)", count(func(w walLine) bool { return w.rmgr == "Heap" && strings.HasPrefix(w.kind, "LOCK") }))
	row("commit records", count(func(w walLine) bool { return w.rmgr == "Transaction" && w.kind == "COMMIT" }))
	row("WAL records", count(func(walLine) bool { return true }))
	row("WAL bytes (records)", func(r stmtRun) string {
		_, b := r.walSum(func(walLine) bool { return true })
		return r.per(b)
	})
	row("WAL bytes, LSN to LSN (with alignment, page headers)", func(r stmtRun) string { return r.per(r.walLSN) })
	return sb.String()
}

// walCategory says what a WAL record is for.
func walCategory(w walLine) string {
	switch w.rmgr {
	case "Heap":
		switch w.kind {
		case "INSERT":
			return "new rows (heap)"
		case "HEAP_CONFIRM":
			return "ON CONFLICT: new row confirmed"
		case "UPDATE":
			return "row versions, non-HOT updates (heap)"
		case "HOT_UPDATE":
			return "row versions, HOT updates (heap)"
		case "DELETE":
			return "deletes (heap)"
		}
		if strings.HasPrefix(w.kind, "LOCK") {
			return "row locks, " + strings.Trim(strings.TrimPrefix(w.kind, "LOCK "), "()")
		}
	case "Btree":
		switch w.kind {
		case "INSERT_LEAF", "INSERT_POST":
			return "index entries"
		case "SPLIT_L", "SPLIT_R", "INSERT_UPPER", "NEWROOT", "INSERT_META":
			return "index page splits"
		case "DELETE", "DEDUP":
			return "index clean-up (bottom-up deletion, deduplication)"
		}
	case "Heap2":
		if w.kind == "PRUNE" {
			return "page pruning (heap)"
		}
	case "Transaction":
		return "commit records"
	}
	return "other: " + w.rmgr + " " + w.kind
}

// categoryOrder is the order walTable lists categories in: rows, then
// locks, indexes, housekeeping.
var categoryOrder = []string{"new rows", "ON CONFLICT", "row versions, non-HOT", "row versions, HOT", "deletes",
	"row locks, FOR UPDATE", "row locks, FOR NO KEY", "row locks, FOR KEY", "index entries", "index page", "index clean-up",
	"page pruning", "commit records"}

func categoryRank(c string) int {
	for i, prefix := range categoryOrder {
		if strings.HasPrefix(c, prefix) {
			return i
		}
	}
	return len(categoryOrder)
}

// walTable is where each scenario's WAL bytes went, by what they were for.
func walTable(runs []stmtRun) string {
	var cats []string
	for _, r := range runs {
		for _, w := range r.wal {
			if c := walCategory(w); !slices.Contains(cats, c) {
				cats = append(cats, c)
			}
		}
	}
	slices.SortFunc(cats, func(a, b string) int {
		return cmp.Or(cmp.Compare(categoryRank(a), categoryRank(b)), cmp.Compare(a, b))
	})
	var sb strings.Builder
	sb.WriteString(header("WAL bytes a job, by what for", runs))
	for _, c := range cats {
		sb.WriteString("| " + c + " |")
		for _, r := range runs {
			_, b := r.walSum(func(w walLine) bool { return walCategory(w) == c })
			sb.WriteString(" " + r.per(b) + " |")
		}
		sb.WriteString("\n")
	}
	sb.WriteString("| **all records** |")
	for _, r := range runs {
		_, b := r.walSum(func(walLine) bool { return true })
		sb.WriteString(" " + r.per(b) + " |")
	}
	sb.WriteString("\n")
	return sb.String()
}

var (
	predCast = regexp.MustCompile(`::text`)
	predAny  = regexp.MustCompile(`= ANY \(ARRAY\[([^\]]*)\]\)`)
)

// indexTable is the entries each index received a job, scenario by
// scenario: every index of the tables any scenario wrote to.
func (b *stmtBench) indexTable(runs []stmtRun) string {
	written := map[string]bool{}
	for _, r := range runs {
		for _, s := range r.tables {
			written[s.name] = true
		}
	}
	var sb strings.Builder
	sb.WriteString(header("index entries a job (partial: WHERE …)", runs))
	for _, ix := range b.indexes {
		if !written[ix.table] {
			continue
		}
		name := ix.name
		if ix.predicate != "" {
			pred := predAny.ReplaceAllString(predCast.ReplaceAllString(ix.predicate, ""), "IN ($1)")
			name += " WHERE " + strings.TrimSuffix(strings.TrimPrefix(pred, "("), ")")
		}
		sb.WriteString("| " + name + " |")
		for _, r := range runs {
			sb.WriteString(" " + r.per(float64(r.indexEntries[ix.name])) + " |")
		}
		sb.WriteString("\n")
	}
	return sb.String()
}
