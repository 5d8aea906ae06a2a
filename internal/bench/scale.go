package bench

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime"
	"slices"
	"strings"
	"sync/atomic"
	"text/tabwriter"
	"time"

	"github.com/google/uuid"
	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"golang.org/x/sync/errgroup"

	"github.com/keeljobs/keel/internal/jobstore"
	"github.com/keeljobs/keel/internal/ledger"
	"github.com/keeljobs/keel/internal/pgserver"
	"github.com/keeljobs/keel/outbox"
	"github.com/keeljobs/keel/server"
	"github.com/keeljobs/keel/tasks"
)

// Sizes of the scale part.
const (
	DefaultScaleFinished = 10_000_000
	DefaultScaleOpen     = 100_000
	// ScaleBaselineDivisor: the baseline ledger holds this fraction of the
	// big one's finished jobs (and as many open ones).
	ScaleBaselineDivisor = 100
	// ScaleIntake is the intake the pruning must keep up with, in jobs
	// per second; the scale part prunes once while a worker runs that many.
	ScaleIntake = 1000
	// scaleLoadChunk is how many rows one loading statement inserts.
	scaleLoadChunk = 1_000_000
	// scaleDays is how far back ledger.LoadFinished spreads the finished
	// jobs' finish times (its statement says so): with the default 30-day
	// retention a quarter of them are due.
	scaleDays = 40
)

// DefaultScaleSettings are the private Postgres's settings: a small
// production server's rather than a laptop's (shared_buffers, WAL room),
// durable, with autovacuum at its defaults. ScalePostgresSettings come
// after them and win.
func DefaultScaleSettings() []string {
	return []string{"shared_buffers=1GB", "max_wal_size=4GB", "fsync=on", "synchronous_commit=on",
		"autovacuum=on", "max_connections=100"}
}

// scaleShownSettings are the settings the report prints.
var scaleShownSettings = []string{"server_version", "autovacuum", "autovacuum_naptime", "autovacuum_vacuum_scale_factor",
	"autovacuum_vacuum_cost_delay", "autovacuum_vacuum_cost_limit", "shared_buffers", "max_wal_size", "fsync",
	"synchronous_commit", "maintenance_work_mem", "work_mem"}

// The kinds of the loaded jobs; the measured ones are Kind and these.
const (
	scaleRoundKind   = "bench:round"
	scaleEnqueueKind = "bench:enqueue"
	scaleHolder      = "bench-scale-holder"
)

// ScaleReport is the scale part's result: every figure on a small ledger
// (the baseline) and on the big one, in the same run.
type ScaleReport struct {
	// Server says which Postgres held the ledgers; Settings are its
	// settings that bear on the figures.
	Server   string       `json:"server"`
	Settings []PGSetting  `json:"settings"`
	Small    *ScaleLedger `json:"small,omitempty"`
	Big      *ScaleLedger `json:"big,omitempty"`
	// IntakePerSecond is ScaleIntake. PruneHeadroom is the big ledger's
	// prune rate (alone) over it; KeepsUp says it is above 1 while the
	// intake runs too.
	IntakePerSecond float64 `json:"intake_per_second"`
	PruneHeadroom   float64 `json:"prune_headroom"`
	KeepsUp         bool    `json:"prune_keeps_up"`
	// PruneIntervalSeconds is outbox.DefaultPruneInterval; PassSeconds
	// is how long one prune pass at the big ledger's rate takes to remove
	// what that interval of intake leaves due.
	PruneIntervalSeconds float64 `json:"prune_interval_seconds"`
	PassSeconds          float64 `json:"prune_pass_seconds"`
}

// PGSetting is one Postgres setting as the server shows it.
type PGSetting struct {
	Name  string `json:"name"`
	Value string `json:"value"`
}

// ScaleLedger is what one ledger measured.
type ScaleLedger struct {
	Name     string `json:"name"`
	Finished int    `json:"finished"`
	Open     int    `json:"open"`
	// LoadSeconds is the INSERT … SELECT of every row; VacuumAnalyzeSeconds
	// the VACUUM ANALYZE after it, which leaves the table as a long-lived
	// one would be (hint bits, visibility map, statistics).
	LoadSeconds          float64 `json:"load_seconds"`
	LoadRowsPerSecond    float64 `json:"load_rows_per_second"`
	VacuumAnalyzeSeconds float64 `json:"vacuum_analyze_seconds"`
	CheckpointSeconds    float64 `json:"checkpoint_seconds"`
	Loaded               Sizes   `json:"sizes_loaded"`

	// Worker is a keel worker running ScaleJobs no-op jobs.
	Worker ScaleWorker `json:"worker"`
	// Claim and Complete are the guard's round statement with one job,
	// ScaleSamples times each, one at a time.
	Claim    Latency `json:"claim_round"`
	Complete Latency `json:"complete_round"`
	// EnqueueTx is one job per transaction (begin, EnqueueTx, commit).
	EnqueueTx Latency `json:"enqueue_tx"`
	// Reconcile is one reconciler pass over the open jobs, all present in
	// Redis (the steady state).
	Reconcile ReconcilePass `json:"reconcile"`
	// Plans are the hot statements' plans on this ledger.
	Plans []Plan `json:"plans"`
	// Prunes: first alone (jobs older than 35 of the 40 days), then the
	// rest of what the default retention makes due while a worker runs
	// ScaleIntake jobs a second.
	Prunes []PruneRun `json:"prunes"`
	Vacuum VacuumRun  `json:"vacuum"`
}

// Sizes are the ledger table's sizes.
type Sizes struct {
	Rows         int64       `json:"rows"`
	TableBytes   int64       `json:"table_bytes"`
	ToastBytes   int64       `json:"toast_bytes"`
	IndexesBytes int64       `json:"indexes_bytes"`
	Indexes      []IndexSize `json:"indexes"`
	// BytesPerRow is the table and its indexes over the rows.
	BytesPerRow float64 `json:"bytes_per_row"`
}

// IndexSize is one index's size.
type IndexSize struct {
	Name  string `json:"name"`
	Bytes int64  `json:"bytes"`
}

// ScaleWorker is a keel worker's run of no-op jobs.
type ScaleWorker struct {
	Jobs          int     `json:"jobs"`
	Seconds       float64 `json:"seconds"`
	JobsPerSecond float64 `json:"jobs_per_second"`
}

// ReconcilePass is one reconciler pass, timed, with the Go heap it used.
type ReconcilePass struct {
	// Rows is how many open jobs the pass read; Republished must be 0.
	Rows        int     `json:"rows"`
	Republished int     `json:"republished"`
	Seconds     float64 `json:"seconds"`
	// AllocMiB is what the pass allocated (TotalAlloc's growth);
	// PeakHeapMiB the most heap in use while it ran, over the heap in use
	// before it (sampled every 5ms).
	AllocMiB    float64 `json:"alloc_mib"`
	PeakHeapMiB float64 `json:"peak_heap_growth_mib"`
}

// Plan is a statement's plan: its scans and execution time.
type Plan struct {
	Statement string   `json:"statement"`
	Scans     []string `json:"scans"`
	SeqScan   bool     `json:"seq_scan"`
	Ms        float64  `json:"execution_ms"`
}

// PruneRun is one Prune call (the reconciler's, PruneBatch 1000).
type PruneRun struct {
	Name          string  `json:"name"`
	RetentionDays float64 `json:"retention_days"`
	Rows          int     `json:"rows"`
	Seconds       float64 `json:"seconds"`
	RowsPerSecond float64 `json:"rows_per_second"`
	// With the intake running: jobs fed and processed meanwhile, and the
	// most that were waiting at once.
	Fed       int `json:"fed,omitempty"`
	Processed int `json:"processed,omitempty"`
	MaxLag    int `json:"max_lag,omitempty"`
}

// VacuumRun is what pruning left and what vacuum made of it.
type VacuumRun struct {
	// DeadTuples after pruning; Autovacuums is how many autovacuum runs of
	// keel_jobs finished from the first prune until VACUUM, and
	// AutovacuumSeconds how long the last one waited for took (0 when
	// none was waited for).
	DeadTuples        int64   `json:"dead_tuples_after_prune"`
	AutovacuumDue     bool    `json:"autovacuum_due"`
	Autovacuums       int64   `json:"autovacuums"`
	AutovacuumSeconds float64 `json:"autovacuum_seconds,omitempty"`
	// Seconds is a manual VACUUM after that; DeadTuplesAfter what it left.
	Seconds         float64 `json:"vacuum_seconds"`
	DeadTuplesAfter int64   `json:"dead_tuples_after_vacuum"`
	Pruned          Sizes   `json:"sizes_pruned"`
	Vacuumed        Sizes   `json:"sizes_vacuumed"`
}

// scaleDB is where the scale part's ledgers live.
type scaleDB struct {
	pool   *pgxpool.Pool
	server *pgserver.Server // nil with ScaleDatabaseURL
	url    string
	schema string
}

func (d *scaleDB) close(ctx context.Context) error {
	var err error
	if d.pool != nil {
		_, err = d.pool.Exec(ctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{d.schema}.Sanitize()+" CASCADE")
		d.pool.Close()
	}
	if d.server != nil {
		d.server.Remove()
	}
	return err
}

// openScaleDB starts the private Postgres (or connects to
// ScaleDatabaseURL) and migrates a ledger into the scale schema.
func (e *env) openScaleDB(ctx context.Context) (*scaleDB, error) {
	d := &scaleDB{url: e.o.ScaleDatabaseURL, schema: e.o.Schema + "_scale"}
	if d.url == "" {
		s, err := pgserver.Init(append(DefaultScaleSettings(), e.o.ScalePostgresSettings...)...)
		if err != nil {
			return nil, fmt.Errorf("%w (or point the scale part at a database: --scale-database-url)", err)
		}
		d.server = s
		if err := s.Start(); err != nil {
			s.Remove()
			return nil, err
		}
		d.url = s.URL("")
	}
	pool, err := ledgerPool(ctx, Options{DatabaseURL: d.url, Schema: d.schema})
	if err != nil {
		d.close(ctx) //nolint:errcheck // the first error says more
		return nil, err
	}
	d.pool = pool
	return d, nil
}

func (e *env) scale(ctx context.Context) (ScaleReport, error) {
	o := e.o
	rep := ScaleReport{IntakePerSecond: ScaleIntake, PruneIntervalSeconds: outbox.DefaultPruneInterval.Seconds()}
	d, err := e.openScaleDB(ctx)
	if err != nil {
		return rep, err
	}
	defer func() {
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
		defer cancel()
		d.close(cctx) //nolint:errcheck // a failed drop goes with the private server
		_ = clearQueues(e.redis)
	}()
	if d.server != nil {
		rep.Server = fmt.Sprintf("a private Postgres (initdb for this run, %s)", d.server)
	} else {
		rep.Server = "the database of --scale-database-url"
	}
	if rep.Settings, err = pgSettings(ctx, d.pool); err != nil {
		return rep, err
	}
	s := &scaleRun{env: e, pool: d.pool}
	small, err := s.ledger(ctx, "small", o.ScaleFinished/ScaleBaselineDivisor, o.ScaleOpen)
	rep.Small = &small
	if err != nil {
		return rep, fmt.Errorf("small ledger: %w", err)
	}
	big, err := s.ledger(ctx, "big", o.ScaleFinished, o.ScaleOpen)
	rep.Big = &big
	if err != nil {
		return rep, fmt.Errorf("big ledger: %w", err)
	}
	if len(big.Prunes) > 0 {
		alone := big.Prunes[0].RowsPerSecond
		rep.PruneHeadroom = alone / ScaleIntake
		rep.PassSeconds = ScaleIntake * rep.PruneIntervalSeconds / alone
		rep.KeepsUp = true
		for _, p := range big.Prunes {
			rep.KeepsUp = rep.KeepsUp && p.RowsPerSecond > ScaleIntake
		}
	}
	return rep, nil
}

// scaleRun measures ledgers in pool.
type scaleRun struct {
	*env
	pool *pgxpool.Pool
}

// ledger loads a ledger of finished and open jobs and measures it.
func (s *scaleRun) ledger(ctx context.Context, name string, finished, open int) (ScaleLedger, error) {
	l := ScaleLedger{Name: name, Finished: finished, Open: open}
	if err := ledger.EmptyLedgerAndPruneLog(ctx, s.pool); err != nil {
		return l, err
	}
	if err := clearQueues(s.redis); err != nil {
		return l, err
	}
	if err := s.load(ctx, &l); err != nil {
		return l, fmt.Errorf("load: %w", err)
	}
	var err error
	if l.Loaded, err = tableSizes(ctx, s.pool); err != nil {
		return l, err
	}
	if l.Plans, err = s.plans(ctx); err != nil {
		return l, fmt.Errorf("plans: %w", err)
	}
	if l.Claim, l.Complete, err = s.rounds(ctx, name); err != nil {
		return l, fmt.Errorf("claim/complete rounds: %w", err)
	}
	if l.Worker, err = s.worker(ctx, name); err != nil {
		return l, fmt.Errorf("worker: %w", err)
	}
	if l.EnqueueTx, err = s.enqueueTx(ctx, name); err != nil {
		return l, fmt.Errorf("EnqueueTx: %w", err)
	}
	if l.Reconcile, err = s.reconcile(ctx, name, open); err != nil {
		return l, fmt.Errorf("reconciler pass: %w", err)
	}
	before, err := ledger.JobsStats(ctx, s.pool)
	if err != nil {
		return l, err
	}
	p, err := s.prune(ctx, name+": prune alone", 35*24*time.Hour, false)
	l.Prunes = append(l.Prunes, p)
	if err != nil {
		return l, fmt.Errorf("prune: %w", err)
	}
	p, err = s.prune(ctx, fmt.Sprintf("%s: prune, %d jobs/s running", name, ScaleIntake), outbox.DefaultRetention, true)
	l.Prunes = append(l.Prunes, p)
	if err != nil {
		return l, fmt.Errorf("prune with intake: %w", err)
	}
	if l.Vacuum, err = s.vacuum(ctx, name, before); err != nil {
		return l, fmt.Errorf("vacuum: %w", err)
	}
	return l, nil
}

func (s *scaleRun) load(ctx context.Context, l *ScaleLedger) error {
	var loaded atomic.Int64
	finish := s.step(l.Name+": load", l.Finished+l.Open, func() int { return int(loaded.Load()) })
	start := time.Now()
	for lo := 0; lo < l.Finished; lo += scaleLoadChunk {
		hi := min(l.Finished, lo+scaleLoadChunk)
		if err := ledger.LoadFinished(ctx, s.pool, lo, hi, float64(l.Finished)); err != nil {
			finish()
			return err
		}
		loaded.Store(int64(hi))
	}
	err := ledger.LoadOpen(ctx, s.pool, l.Open, scaleHolder)
	loaded.Add(int64(l.Open))
	l.LoadSeconds = time.Since(start).Seconds()
	l.LoadRowsPerSecond = float64(l.Finished+l.Open) / l.LoadSeconds
	finish()
	if err != nil {
		return err
	}
	finish = s.step(l.Name+": VACUUM ANALYZE, CHECKPOINT", 1, func() int { return 0 })
	defer finish()
	start = time.Now()
	if err = ledger.VacuumAnalyzeJobs(ctx, s.pool); err != nil {
		return err
	}
	l.VacuumAnalyzeSeconds = time.Since(start).Seconds()
	// Write the loaded pages out now: otherwise every commit measured next
	// waits behind their writeback (an fsync flushes the file system's
	// journal), which a long-lived ledger does not do.
	start = time.Now()
	_, err = s.pool.Exec(ctx, `CHECKPOINT`)
	l.CheckpointSeconds = time.Since(start).Seconds()
	return err
}

func pgSettings(ctx context.Context, pool *pgxpool.Pool) ([]PGSetting, error) {
	rows, err := pool.Query(ctx, `SELECT n, current_setting(n) FROM unnest($1::text[]) n`, scaleShownSettings)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowToStructByPos[PGSetting])
}

func tableSizes(ctx context.Context, pool *pgxpool.Pool) (Sizes, error) {
	t, err := ledger.JobsSize(ctx, pool)
	if err != nil {
		return Sizes{}, err
	}
	z := Sizes{Rows: t.Rows, TableBytes: t.TableBytes, ToastBytes: t.ToastBytes, IndexesBytes: t.IndexesBytes,
		Indexes: make([]IndexSize, len(t.Indexes))}
	for i, ix := range t.Indexes {
		z.Indexes[i] = IndexSize(ix)
	}
	if z.Rows > 0 {
		z.BytesPerRow = float64(z.TableBytes+z.ToastBytes+z.IndexesBytes) / float64(z.Rows)
	}
	return z, nil
}

// plans explains the hot statements on the loaded ledger (writes rolled
// back): the guard's round with 50 claims and 50 completions, the relay's
// claim, a reconciler and a rescue page, a prune batch.
func (s *scaleRun) plans(ctx context.Context) ([]Plan, error) {
	claim, err := ledger.FirstPending(ctx, s.pool)
	if err != nil {
		return nil, err
	}
	done, err := ledger.FirstHeld(ctx, s.pool, scaleHolder)
	if err != nil {
		return nil, err
	}
	runs := make([]int32, len(done)) // the loaded running rows are at run 1
	for i := range runs {
		runs[i] = 1
	}
	stmts := []struct {
		name, sql string
		args      []any
	}{
		{"guard round: 50 claims + 50 completions", ledger.RoundSQL,
			[]any{scaleHolder, int64(10000), claim, done, runs}},
	}
	for _, st := range []struct {
		name string
		call func(db ledger.DB)
	}{
		{"relay claim (200)", func(db ledger.DB) { ledger.ClaimOutbox(ctx, db, 200, 0, nil) }},                             //nolint:errcheck
		{"relay claim, rows written unpublished (200)", func(db ledger.DB) { ledger.ClaimUnpublished(ctx, db, 200, nil) }}, //nolint:errcheck
		{"reconciler page (1,000)", func(db ledger.DB) {
			ledger.ReconcilePage(ctx, db, outbox.DefaultGrace, "", outbox.DefaultReconcileBatch, nil) //nolint:errcheck
		}},
		{"rescue page (1,000)", func(db ledger.DB) { ledger.RescuePage(ctx, db, "", outbox.DefaultReconcileBatch, nil) }}, //nolint:errcheck
		{"prune batch (1,000)", func(db ledger.DB) {
			ledger.PruneKind(ctx, db, Kind, "succeeded", outbox.DefaultRetention, outbox.DefaultPruneBatch, nil) //nolint:errcheck
		}},
	} {
		sql, args := ledger.Statement(st.call)
		stmts = append(stmts, struct {
			name, sql string
			args      []any
		}{st.name, sql, args})
	}
	var plans []Plan
	for _, st := range stmts {
		p := Plan{Statement: st.name}
		err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
			rows, err := tx.Query(ctx, "EXPLAIN (ANALYZE, COSTS OFF) "+st.sql, st.args...)
			if err != nil {
				return err
			}
			lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
			if err != nil {
				return err
			}
			for _, line := range lines {
				line = strings.TrimSpace(strings.TrimPrefix(strings.TrimSpace(line), "->"))
				if t, ok := strings.CutPrefix(line, "Execution Time: "); ok {
					_, _ = fmt.Sscanf(t, "%f", &p.Ms)
				}
				if node, _, _ := strings.Cut(line, " (actual"); strings.Contains(node, "Scan") {
					if !slices.Contains(p.Scans, strings.TrimSpace(node)) {
						p.Scans = append(p.Scans, strings.TrimSpace(node))
					}
					p.SeqScan = p.SeqScan || strings.HasPrefix(node, "Seq Scan on keel_jobs")
				}
			}
			return errRollback
		})
		if err != nil && !errors.Is(err, errRollback) {
			return plans, fmt.Errorf("%s: %w", st.name, err)
		}
		plans = append(plans, p)
	}
	return plans, nil
}

var errRollback = errors.New("rolled back")

// rounds times the guard's round statement: ScaleSamples jobs, each claimed
// in a round of its own and then completed in another; their rows are
// removed after.
func (s *scaleRun) rounds(ctx context.Context, name string) (claim, complete Latency, err error) {
	n := s.o.ScaleSamples
	prefix := "round-" + uuid.NewString()[:8] + "-"
	if err := ledger.FillRoundJobs(ctx, s.pool, prefix, scaleRoundKind, Queue, payload, n); err != nil {
		return claim, complete, err
	}
	var done atomic.Int64
	finish := s.step(name+": claim and complete rounds, 1 job each", n, func() int { return int(done.Load()) })
	defer finish()
	round := func(claimIDs, doneIDs []string, attempts []int32) (time.Duration, error) {
		t0 := time.Now()
		rows, err := s.pool.Query(ctx, ledger.RoundSQL, scaleHolder, int64(10000), claimIDs, doneIDs, attempts)
		if err != nil {
			return 0, err
		}
		got := 0
		for rows.Next() {
			got++
		}
		rows.Close()
		if err := rows.Err(); err != nil {
			return 0, err
		}
		if got != 1 {
			return 0, fmt.Errorf("round of %v/%v returned %d rows, want 1", claimIDs, doneIDs, got)
		}
		return time.Since(t0), nil
	}
	cs, ds := make([]time.Duration, 0, n), make([]time.Duration, 0, n)
	for i := range n {
		id := fmt.Sprintf("%s%08d", prefix, i)
		d, err := round([]string{id}, []string{}, []int32{})
		if err != nil {
			return claim, complete, err
		}
		cs = append(cs, d)
		if d, err = round([]string{}, []string{id}, []int32{1}); err != nil {
			return claim, complete, err
		}
		ds = append(ds, d)
		done.Add(1)
	}
	err = ledger.DeleteKind(ctx, s.pool, scaleRoundKind)
	return summarize(cs), summarize(ds), err
}

// worker runs ScaleJobs no-op jobs through a keel worker (no reconciler:
// its pruning would run too) and checks the ledger.
func (s *scaleRun) worker(ctx context.Context, name string) (ScaleWorker, error) {
	n := s.o.ScaleJobs
	w := ScaleWorker{Jobs: n}
	ctx, cancel := context.WithTimeout(ctx, s.o.timeout(n))
	defer cancel()
	f := &feeder{pool: s.pool, r: s.redis, prefix: "noop-" + uuid.NewString()[:8] + "-"}
	defer f.close()
	if err := f.feed(ctx, n); err != nil {
		return w, err
	}
	c := newCounter(n)
	srv, err := s.scaleServer(c)
	if err != nil {
		return w, err
	}
	finish := s.step(fmt.Sprintf("%s: keel worker, %d no-op jobs", name, n), n, c.done)
	start := time.Now()
	run := startServer(srv)
	err = waitEmpty(ctx, s.redis, c, run.stopped)
	w.Seconds = time.Since(start).Seconds()
	finish()
	err = errors.Join(err, run.stop())
	if err != nil {
		return w, err
	}
	w.JobsPerSecond = float64(n) / w.Seconds
	lc, err := ledgerCheck(ctx, s.pool, LedgerCheck{})
	if err == nil && (lc.Succeeded != n || lc.NotSucceeded != 0 || lc.Attempts != n) {
		err = fmt.Errorf("ledger check failed: %d of %d jobs succeeded, %d not, %d attempts", lc.Succeeded, n, lc.NotSucceeded, lc.Attempts)
	}
	if err == nil {
		err = ledger.DeleteKind(ctx, s.pool, Kind)
	}
	return w, err
}

func (s *scaleRun) scaleServer(h asynq.Handler) (*server.Server, error) {
	return server.New(server.Config{Redis: s.redis, Pool: s.pool, Queues: Queues(), Concurrency: s.o.Concurrency,
		DisableReconciler: true, Logger: s.warn}, h)
}

// feeder records no-op jobs in the ledger as published and puts them in
// Redis, as prefillKeel does, in any number of calls.
type feeder struct {
	pool   *pgxpool.Pool
	r      asynq.RedisClientOpt
	prefix string
	next   int
	client *asynq.Client
}

func (f *feeder) close() {
	if f.client != nil {
		f.client.Close()
	}
}

func (f *feeder) feed(ctx context.Context, n int) error {
	if f.client == nil {
		f.client = asynq.NewClient(f.r)
	}
	from := f.next
	f.next += n
	if err := ledger.FillPublishedRange(ctx, f.pool, f.prefix, Kind, Queue, payload, from, from+n); err != nil {
		return fmt.Errorf("ledger rows: %w", err)
	}
	return parallel(ctx, n, func(i int) error {
		jid := fmt.Sprintf("%s%09d", f.prefix, from+i)
		t := asynq.NewTaskWithHeaders(Kind, payload, map[string]string{jobstore.HeaderBusinessKey: jid})
		_, err := f.client.EnqueueContext(ctx, t, asynq.TaskID(jid), asynq.Queue(Queue), asynq.MaxRetry(3))
		return err
	})
}

// parallel calls fn(0…n-1) from 32 goroutines and returns the first error.
func parallel(ctx context.Context, n int, fn func(i int) error) error {
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(32)
	for i := range n {
		if gctx.Err() != nil {
			break
		}
		g.Go(func() error { return fn(i) })
	}
	if err := g.Wait(); err != nil {
		return err
	}
	return ctx.Err()
}

// enqueueTx times ScaleSamples EnqueueTx calls, one job per transaction,
// one at a time, and removes their rows.
func (s *scaleRun) enqueueTx(ctx context.Context, name string) (Latency, error) {
	n := s.o.ScaleSamples
	client, err := tasks.NewClient(tasks.ClientConfig{Redis: s.redis, Pool: s.pool, Logger: s.warn})
	if err != nil {
		return Latency{}, err
	}
	defer client.Close()
	ds := make([]time.Duration, 0, n)
	// The progress line reads the count from its own goroutine.
	var calls atomic.Int64
	finish := s.step(name+": EnqueueTx, 1 job/tx", n, func() int { return int(calls.Load()) })
	prefix := "enq-" + uuid.NewString()[:8] + "-"
	for i := range n {
		t0 := time.Now()
		err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
			_, err := client.EnqueueTx(ctx, tx, tasks.NewRaw(scaleEnqueueKind, payload, fmt.Sprintf("%s%d", prefix, i), tasks.Queue(Queue)))
			return err
		})
		if err != nil {
			finish()
			return summarize(ds), err
		}
		ds = append(ds, time.Since(t0))
		calls.Add(1)
	}
	finish()
	// Nothing publishes them: no relay runs.
	err = ledger.DeleteKind(ctx, s.pool, scaleEnqueueKind)
	return summarize(ds), err
}

// reconcile puts the open jobs in Redis as a steady state has them
// (pending ones queued, failed ones waiting for their retry; running ones
// are held by their lease and not looked up), then times three passes
// and keeps the median.
func (s *scaleRun) reconcile(ctx context.Context, name string, open int) (ReconcilePass, error) {
	var pass ReconcilePass
	jobs, err := ledger.WaitingJobs(ctx, s.pool)
	if err != nil {
		return pass, err
	}
	ac := asynq.NewClient(s.redis)
	defer ac.Close()
	var put atomic.Int64
	finish := s.step(name+": open jobs into Redis", len(jobs), func() int { return int(put.Load()) })
	err = parallel(ctx, len(jobs), func(i int) error {
		j := jobs[i]
		opts := []asynq.Option{asynq.TaskID(j.ID), asynq.Queue(j.Queue)}
		if j.Status == "failed" {
			opts = append(opts, asynq.ProcessIn(time.Hour))
		}
		_, err := ac.EnqueueContext(ctx, asynq.NewTask(j.Kind, payload), opts...)
		put.Add(1)
		return err
	})
	finish()
	if err != nil {
		return pass, err
	}
	defer clearQueues(s.redis) //nolint:errcheck // the next step clears them too
	quiet := slog.New(levelAtLeast{s.o.Logger.Handler(), slog.LevelError})
	recon, err := outbox.NewReconciler(outbox.ReconcilerConfig{Pool: s.pool, Redis: s.redis, Logger: quiet})
	if err != nil {
		return pass, err
	}
	defer recon.Close()
	if pass.Rows, err = ledger.Reconcilable(ctx, s.pool, outbox.DefaultGrace); err != nil {
		return pass, err
	}
	const passes = 3
	var runs []ReconcilePass
	// The progress line reads the count from its own goroutine.
	var passed atomic.Int64
	finish = s.step(fmt.Sprintf("%s: reconciler passes over %d open jobs", name, open), passes, func() int { return int(passed.Load()) })
	defer finish()
	for range passes {
		p := pass
		runtime.GC()
		var before runtime.MemStats
		runtime.ReadMemStats(&before)
		peak := before.HeapInuse
		stop, sampled := make(chan struct{}), make(chan struct{})
		go func() {
			defer close(sampled)
			var m runtime.MemStats
			t := time.NewTicker(5 * time.Millisecond)
			defer t.Stop()
			for {
				select {
				case <-stop:
					return
				case <-t.C:
					runtime.ReadMemStats(&m)
					peak = max(peak, m.HeapInuse)
				}
			}
		}()
		start := time.Now()
		n, err := recon.Reconcile(ctx)
		p.Seconds = time.Since(start).Seconds()
		close(stop)
		<-sampled
		var after runtime.MemStats
		runtime.ReadMemStats(&after)
		peak = max(peak, after.HeapInuse)
		p.Republished = n
		p.AllocMiB = float64(after.TotalAlloc-before.TotalAlloc) / (1 << 20)
		p.PeakHeapMiB = float64(peak-before.HeapInuse) / (1 << 20)
		runs = append(runs, p)
		passed.Add(1)
		if err != nil {
			return p, err
		}
		if n != 0 {
			return p, fmt.Errorf("the pass published %d jobs again that Redis holds", n)
		}
	}
	slices.SortFunc(runs, func(a, b ReconcilePass) int { return cmp.Compare(a.Seconds, b.Seconds) })
	return runs[len(runs)/2], nil
}

// prune runs the reconciler's Prune (default PruneBatch) with retention;
// with intake, a feeder puts ScaleIntake no-op jobs a second into the
// ledger and Redis meanwhile and a keel worker runs them.
func (s *scaleRun) prune(ctx context.Context, name string, retention time.Duration, intake bool) (PruneRun, error) {
	p := PruneRun{Name: name, RetentionDays: retention.Hours() / 24}
	due64, err := ledger.Prunable(ctx, s.pool, retention, outbox.DefaultDeadDropNotice, nil)
	due := int(due64)
	if err != nil {
		return p, err
	}
	deleted0, err := ledger.JobsDeleted(ctx, s.pool)
	if err != nil {
		return p, err
	}
	// Progress from the statistics, which backends flush about once a
	// second; the figures come from Prune's own count.
	var progress atomic.Int64
	finish := s.step(name, due, func() int {
		qctx, cancel := context.WithTimeout(ctx, time.Second)
		defer cancel()
		if d, err := ledger.JobsDeleted(qctx, s.pool); err == nil {
			progress.Store(d - deleted0)
		}
		return int(progress.Load())
	})
	defer finish()
	var stopIntake func() (fed, processed, maxLag int, err error)
	if intake {
		var err error
		if stopIntake, err = s.startIntake(ctx); err != nil {
			return p, err
		}
	}
	recon, err := outbox.NewReconciler(outbox.ReconcilerConfig{Pool: s.pool, Redis: s.redis, Retention: retention, Logger: s.warn})
	if err != nil {
		return p, err
	}
	defer recon.Close()
	start := time.Now()
	n, err := recon.Prune(ctx)
	p.Seconds = time.Since(start).Seconds()
	p.Rows = n
	p.RowsPerSecond = float64(n) / p.Seconds
	if stopIntake != nil {
		fed, processed, lag, ierr := stopIntake()
		p.Fed, p.Processed, p.MaxLag = fed, processed, lag
		err = errors.Join(err, ierr)
	}
	if err == nil && n < due {
		err = fmt.Errorf("pruned %d of %d due rows", n, due)
	}
	return p, err
}

// startIntake feeds ScaleIntake no-op jobs a second (a tenth each 100ms)
// to a keel worker until the returned function is called, which waits
// until the worker has run every job fed.
func (s *scaleRun) startIntake(ctx context.Context) (stop func() (fed, processed, maxLag int, err error), err error) {
	c := newCounter(-1)
	srv, err := s.scaleServer(c)
	if err != nil {
		return nil, err
	}
	run := startServer(srv)
	f := &feeder{pool: s.pool, r: s.redis, prefix: "intake-" + uuid.NewString()[:8] + "-"}
	var maxLag int
	var feedErr error
	stopFeed, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		const per = ScaleIntake / 10
		t := time.NewTicker(100 * time.Millisecond)
		defer t.Stop()
		for {
			select {
			case <-stopFeed:
				return
			case <-ctx.Done():
				return
			case <-t.C:
			}
			if feedErr = f.feed(ctx, per); feedErr != nil {
				return
			}
			maxLag = max(maxLag, f.next-c.done())
		}
	}()
	return func() (int, int, int, error) {
		close(stopFeed)
		<-done
		defer f.close()
		wctx, wcancel := context.WithTimeout(ctx, time.Minute)
		defer wcancel()
		err := registerQueues(s.redis) // the inspector knows no queue it never saw
		if err == nil {
			err = waitEmpty(wctx, s.redis, c, run.stopped)
		}
		err = errors.Join(feedErr, err, run.stop())
		succeeded, qerr := ledger.SucceededOfKind(ctx, s.pool, Kind)
		if qerr != nil {
			err = errors.Join(err, qerr)
		}
		if err == nil && (succeeded != f.next || c.done() != f.next) {
			err = fmt.Errorf("%d jobs fed, %d succeeded in the ledger, %d handler runs", f.next, succeeded, c.done())
		}
		if derr := ledger.DeleteKind(ctx, s.pool, Kind); derr != nil {
			err = errors.Join(err, derr)
		}
		return f.next, c.done(), maxLag, errors.Join(err, clearQueues(s.redis))
	}, nil
}

// vacuum reads what pruning left, waits for autovacuum when it is due
// (up to two naptimes for it to start), then runs VACUUM.
func (s *scaleRun) vacuum(ctx context.Context, name string, before ledger.TableStats) (VacuumRun, error) {
	var v VacuumRun
	var err error
	if v.Pruned, err = tableSizes(ctx, s.pool); err != nil {
		return v, err
	}
	// The pruning backends flush their statistics within a second.
	time.Sleep(1500 * time.Millisecond)
	st, err := ledger.JobsStats(ctx, s.pool)
	if err != nil {
		return v, err
	}
	v.DeadTuples = st.Dead
	av, err := ledger.JobsAutovacuum(ctx, s.pool)
	if err != nil {
		return v, err
	}
	v.AutovacuumDue = av.On && float64(st.Dead) > av.Threshold+av.ScaleFactor*float64(st.Live+st.Dead)
	if v.AutovacuumDue {
		wait := s.o.ScaleAutovacuumWait
		if wait <= 0 {
			wait = time.Duration(2*av.NaptimeSeconds+10) * time.Second
		}
		finish := s.step(name+": waiting for autovacuum", 1, func() int { return 0 })
		started, took, err := s.waitAutovacuum(ctx, st.Autovacuums, wait)
		finish()
		if err != nil {
			return v, err
		}
		if started {
			v.AutovacuumSeconds = took.Seconds()
		}
	}
	finish := s.step(name+": VACUUM", 1, func() int { return 0 })
	start := time.Now()
	err = ledger.VacuumJobs(ctx, s.pool)
	v.Seconds = time.Since(start).Seconds()
	finish()
	if err != nil {
		return v, err
	}
	time.Sleep(1500 * time.Millisecond)
	if st, err = ledger.JobsStats(ctx, s.pool); err != nil {
		return v, err
	}
	v.DeadTuplesAfter = st.Dead
	v.Autovacuums = st.Autovacuums - before.Autovacuums
	v.Vacuumed, err = tableSizes(ctx, s.pool)
	return v, err
}

// waitAutovacuum waits up to wait for an autovacuum of keel_jobs to
// start (or to have finished since count), then for it to finish.
func (s *scaleRun) waitAutovacuum(ctx context.Context, count int64, wait time.Duration) (started bool, took time.Duration, err error) {
	deadline := time.Now().Add(wait)
	var startedAt time.Time
	for {
		running, n, err := ledger.Vacuuming(ctx, s.pool)
		if err != nil {
			return false, 0, err
		}
		switch {
		case running && startedAt.IsZero():
			startedAt = time.Now()
		case n > count:
			if startedAt.IsZero() {
				return true, 0, nil // it ran between two looks
			}
			return true, time.Since(startedAt), nil
		case startedAt.IsZero() && time.Now().After(deadline):
			return false, 0, nil
		}
		select {
		case <-ctx.Done():
			return false, 0, ctx.Err()
		case <-time.After(500 * time.Millisecond):
		}
	}
}

// String renders the report.
func (r ScaleReport) String() string {
	var sb strings.Builder
	if r.Small == nil || r.Big == nil {
		fmt.Fprintf(&sb, "Postgres: %s\n", r.Server)
		return sb.String()
	}
	sm, bg := r.Small, r.Big
	fmt.Fprintf(&sb, "two ledgers in the same run: small = %s finished + %s open jobs (the baseline), big = %s finished + %s open;\n"+
		"finished over the last %d days (96%% succeeded, 1%% dead, 1.5%% discarded, 1.5%% cancelled), open: 60%% pending, 30%% failed, 10%% running\n",
		count(sm.Finished), count(sm.Open), count(bg.Finished), count(bg.Open), scaleDays)
	fmt.Fprintf(&sb, "Postgres: %s;", r.Server)
	for _, st := range r.Settings {
		fmt.Fprintf(&sb, " %s=%s", st.Name, st.Value)
	}
	fmt.Fprintf(&sb, "\nload: big %s rows in %.0fs (%s rows/s, %s per statement), then VACUUM ANALYZE %.0fs and CHECKPOINT %.0fs; small %.1fs\n\n",
		count(bg.Finished+bg.Open), bg.LoadSeconds, count(int(bg.LoadRowsPerSecond)), count(scaleLoadChunk),
		bg.VacuumAnalyzeSeconds, bg.CheckpointSeconds, sm.LoadSeconds)

	tw := tabwriter.NewWriter(&sb, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "\tsmall\tbig\tbig/small\t")
	row := func(name string, a, b float64, format func(float64) string) {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%.2f\t\n", name, format(a), format(b), ratio(b, a))
	}
	mib := func(v float64) string { return fmt.Sprintf("%.1f", v/(1<<20)) }
	num := func(v float64) string { return count(int(v)) }
	f1 := func(v float64) string { return fmt.Sprintf("%.1f", v) }
	f2 := func(v float64) string { return fmt.Sprintf("%.2f", v) }
	row("rows", float64(sm.Loaded.Rows), float64(bg.Loaded.Rows), num)
	row("table MiB", float64(sm.Loaded.TableBytes), float64(bg.Loaded.TableBytes), mib)
	row("indexes MiB", float64(sm.Loaded.IndexesBytes), float64(bg.Loaded.IndexesBytes), mib)
	for _, ix := range bg.Loaded.Indexes {
		var small int64
		for _, s := range sm.Loaded.Indexes {
			if s.Name == ix.Name {
				small = s.Bytes
			}
		}
		row("  "+ix.Name+" MiB", float64(small), float64(ix.Bytes), mib)
	}
	row("bytes per row (table + indexes)", sm.Loaded.BytesPerRow, bg.Loaded.BytesPerRow, f1)
	row(fmt.Sprintf("keel worker, %s no-op jobs: jobs/s", count(bg.Worker.Jobs)), sm.Worker.JobsPerSecond, bg.Worker.JobsPerSecond, num)
	row("guard round, claim 1 job: p50 ms", sm.Claim.P50, bg.Claim.P50, fmtMs)
	row("  p99 ms", sm.Claim.P99, bg.Claim.P99, fmtMs)
	row("guard round, complete 1 job: p50 ms", sm.Complete.P50, bg.Complete.P50, fmtMs)
	row("  p99 ms", sm.Complete.P99, bg.Complete.P99, fmtMs)
	row("EnqueueTx, 1 job/tx: p50 ms", sm.EnqueueTx.P50, bg.EnqueueTx.P50, fmtMs)
	row("  p99 ms", sm.EnqueueTx.P99, bg.EnqueueTx.P99, fmtMs)
	row(fmt.Sprintf("reconciler pass, %s open jobs read: s", count(bg.Reconcile.Rows)), sm.Reconcile.Seconds, bg.Reconcile.Seconds, f2)
	row("  Go heap allocated MiB", sm.Reconcile.AllocMiB, bg.Reconcile.AllocMiB, f1)
	row("  peak heap in use, growth MiB", sm.Reconcile.PeakHeapMiB, bg.Reconcile.PeakHeapMiB, f1)
	for i := range min(len(sm.Prunes), len(bg.Prunes)) {
		a, b := sm.Prunes[i], bg.Prunes[i]
		label := "prune alone"
		if b.Fed > 0 {
			label = fmt.Sprintf("prune, worker running %s jobs/s", count(ScaleIntake))
		}
		row(fmt.Sprintf("%s (retention %gd): rows", label, b.RetentionDays), float64(a.Rows), float64(b.Rows), num)
		row("  rows/s", a.RowsPerSecond, b.RowsPerSecond, num)
		if b.Fed > 0 {
			row("  jobs fed and run meanwhile", float64(a.Fed), float64(b.Fed), num)
			row("  intake reached, jobs/s", float64(a.Fed)/a.Seconds, float64(b.Fed)/b.Seconds, num)
			row("  most jobs waiting at once", float64(a.MaxLag), float64(b.MaxLag), num)
		}
	}
	row("dead tuples after pruning", float64(sm.Vacuum.DeadTuples), float64(bg.Vacuum.DeadTuples), num)
	row("autovacuum runs, pruning to VACUUM", float64(sm.Vacuum.Autovacuums), float64(bg.Vacuum.Autovacuums), num)
	row("VACUUM s", sm.Vacuum.Seconds, bg.Vacuum.Seconds, f2)
	row("table MiB: loaded", float64(sm.Loaded.TableBytes), float64(bg.Loaded.TableBytes), mib)
	row("  pruned", float64(sm.Vacuum.Pruned.TableBytes), float64(bg.Vacuum.Pruned.TableBytes), mib)
	row("  vacuumed", float64(sm.Vacuum.Vacuumed.TableBytes), float64(bg.Vacuum.Vacuumed.TableBytes), mib)
	row("indexes MiB: loaded", float64(sm.Loaded.IndexesBytes), float64(bg.Loaded.IndexesBytes), mib)
	row("  pruned", float64(sm.Vacuum.Pruned.IndexesBytes), float64(bg.Vacuum.Pruned.IndexesBytes), mib)
	row("  vacuumed", float64(sm.Vacuum.Vacuumed.IndexesBytes), float64(bg.Vacuum.Vacuumed.IndexesBytes), mib)
	tw.Flush()

	av := "autovacuum was not due after pruning (or had already run)"
	if bg.Vacuum.AutovacuumDue {
		av = "autovacuum was due after pruning and did not start within the wait"
		if bg.Vacuum.Autovacuums > 0 {
			av = fmt.Sprintf("autovacuum was due after pruning and ran (%.0fs from when it was seen running)", bg.Vacuum.AutovacuumSeconds)
		}
	}
	fmt.Fprintf(&sb, "\nbig ledger: %s; VACUUM afterwards left %s dead tuples.\n", av, count(int(bg.Vacuum.DeadTuplesAfter)))
	fmt.Fprintf(&sb, "DELETE does not shrink the files: VACUUM marks the space free and new rows reuse it.\n")

	fmt.Fprintf(&sb, "\nplans on the big ledger (EXPLAIN ANALYZE, writes rolled back; small ledger's time in brackets):\n")
	for i, p := range bg.Plans {
		smallMs := 0.0
		if i < len(sm.Plans) {
			smallMs = sm.Plans[i].Ms
		}
		seq := ""
		if p.SeqScan {
			seq = " SEQ SCAN"
		}
		fmt.Fprintf(&sb, "  %s: %s ms (%s)%s: %s\n", p.Statement, fmtMs(p.Ms), fmtMs(smallMs), seq, strings.Join(p.Scans, "; "))
	}
	verdict := "keeps up"
	if !r.KeepsUp {
		verdict = "does NOT keep up"
	}
	fmt.Fprintf(&sb, "\npruning by DELETE %s with an intake of %s jobs/s: %.1f× that alone on the big ledger; a prune every %s\n"+
		"removes the %s rows a minute of that intake leaves due in about %.1fs.\n",
		verdict, count(ScaleIntake), r.PruneHeadroom, time.Duration(r.PruneIntervalSeconds*float64(time.Second)),
		count(int(ScaleIntake*r.PruneIntervalSeconds)), r.PassSeconds)
	return sb.String()
}

// count renders n with thousands separators.
func count(n int) string {
	s := fmt.Sprint(n)
	neg := strings.HasPrefix(s, "-")
	s = strings.TrimPrefix(s, "-")
	var out []byte
	for i := range len(s) {
		if i > 0 && (len(s)-i)%3 == 0 {
			out = append(out, ',')
		}
		out = append(out, s[i])
	}
	if neg {
		return "-" + string(out)
	}
	return string(out)
}
