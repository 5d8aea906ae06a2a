package bench_test

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/keeljobs/keel/internal/bench"
	"github.com/keeljobs/keel/internal/pgserver"
	"github.com/keeljobs/keel/internal/testenv"
	"github.com/keeljobs/keel/outbox"
)

var (
	jobs   = flag.Int("keel.jobs", bench.DefaultJobs, "jobs per worker in BenchmarkLedgerVsPlain")
	rounds = flag.Int("keel.rounds", 1, "rounds (plain then keel) in BenchmarkLedgerVsPlain; the median ratio's round is reported")
)

// TestMain doubles as the memory part's child worker: the smoke test starts
// this test binary again with bench.WorkerEnv set.
func TestMain(m *testing.M) {
	if os.Getenv(bench.WorkerEnv) != "" {
		if err := bench.ServeWorker(context.Background()); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

func options(tb testing.TB, n int) bench.Options {
	r := testenv.Redis(tb, testenv.DBBench) // flushed: the queues start empty
	return bench.Options{
		Jobs:        n,
		RedisAddr:   r.Addr,
		RedisDB:     r.DB,
		DatabaseURL: database(tb, "keel_bench_test"),
		Schema:      "keel_bench_test",
	}
}

// database makes sure the test database exists and returns its URL.
func database(tb testing.TB, schema string) string {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := testenv.PoolConfig(ctx, schema); err != nil {
		tb.Fatal(err)
	}
	return testenv.DatabaseURL()
}

// BenchmarkLedgerVsPlain measures no-op jobs per second on plain Asynq and
// on a keel worker, and the ratio between them:
//
//	go test -run XXX -bench LedgerVsPlain -benchtime 1x ./internal/bench/
//	go test -run XXX -bench LedgerVsPlain -benchtime 1x ./internal/bench/ -args -keel.rounds=3
func BenchmarkLedgerVsPlain(b *testing.B) {
	var plain, keel float64
	for range b.N {
		o := options(b, *jobs)
		o.Rounds = *rounds
		o.Logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
		rep, err := bench.Processing(context.Background(), o)
		if err != nil {
			b.Fatal(err)
		}
		b.Logf("\n%s", rep)
		plain += rep.Plain.JobsPerSecond
		keel += rep.Keel.JobsPerSecond
	}
	n := float64(b.N)
	b.ReportMetric(0, "ns/op")
	b.ReportMetric(plain/n, "plain-jobs/s")
	b.ReportMetric(keel/n, "keel-jobs/s")
	b.ReportMetric(keel/plain, "keel/plain")
}

// TestProcessingSmoke runs a small benchmark as a correctness check: both
// workers process every job, and the ledger records each keel job as
// succeeded after exactly one attempt. It asserts no timing.
func TestProcessingSmoke(t *testing.T) {
	const n = 500
	o := tiny(t, bench.PartProcessing)
	o.Jobs = n
	rep, err := bench.Processing(context.Background(), o)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("\n%s", rep)
	if rep.Plain.JobsPerSecond <= 0 || rep.Keel.JobsPerSecond <= 0 || rep.Ratio <= 0 {
		t.Fatalf("rates not positive: plain %.0f/s, keel %.0f/s", rep.Plain.JobsPerSecond, rep.Keel.JobsPerSecond)
	}
	if rep.Ledger.Succeeded != n || rep.Ledger.NotSucceeded != 0 || rep.Ledger.Attempts != n {
		t.Fatalf("ledger: %+v, want %d succeeded after one attempt each", rep.Ledger, n)
	}
	if rep.Ledger.Claimed != n {
		t.Fatalf("guard claimed %d jobs, want %d", rep.Ledger.Claimed, n)
	}
	// Claims and completion marks are ledger writes: WAL per job can be
	// read (plain asynq's is not measured).
	if rep.Keel.PostgresWALBytes <= 0 || rep.Plain.PostgresWALBytes != 0 {
		t.Fatalf("WAL per job: keel %.0f B, plain %.0f B", rep.Keel.PostgresWALBytes, rep.Plain.PostgresWALBytes)
	}
}

// tiny returns options for a run of part at tiny sizes, in parallel with
// the other parts' tests: each has a Redis server and a schema of its own.
func tiny(t *testing.T, part string) bench.Options { return tinyIn(t, part, "keel_bench_test_"+part) }

// tinyIn is tiny with the schema named: two tests of one part need two.
func tinyIn(t *testing.T, part, schema string) bench.Options {
	t.Parallel()
	o := bench.Options{Jobs: 100, RedisAddr: testenv.StartRedis(t).Addr(), DatabaseURL: database(t, schema), Schema: schema}
	o.Parts = []string{part}
	o.EnqueueJobs = 40
	o.Producers = 4
	o.LatencySamples = 8
	o.LatencyPause = time.Millisecond
	o.RelayJobs = 300
	o.RecoveryJobs = 200
	o.RecoveryInterval = 200 * time.Millisecond
	o.RecoveryGrace = 200 * time.Millisecond
	o.RedeliveryKills = 1
	o.MemoryJobs = 200
	o.MemoryConcurrency = 20
	o.ScaleFinished = 2000
	o.ScaleOpen = 200
	o.ScaleJobs = 100
	o.ScaleSamples = 20
	o.ScaleAutovacuumWait = time.Millisecond // tiny ledgers: do not wait a naptime
	o.WorkerCommand = []string{os.Args[0]}
	return o
}

// run runs one part and checks what every part must give: no error, the
// part's result and nothing else, a table that names it, and JSON.
func run(t *testing.T, o bench.Options) bench.Results {
	t.Helper()
	var mu sync.Mutex
	var steps, finished int
	o.Progress = func(p bench.Progress) {
		mu.Lock()
		defer mu.Unlock()
		if p.Part != o.Parts[0] || p.Index != 1 || p.Parts != 1 || p.Done > p.Total {
			t.Errorf("progress %+v", p)
		}
		if p.Finished {
			finished++
		} else if p.Done == 0 && p.Elapsed == 0 {
			steps++
		}
	}
	res, err := bench.Run(context.Background(), o)
	t.Logf("\n%s", res)
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Errors) != 0 || len(res.Parts) != 1 || res.Parts[0] != o.Parts[0] {
		t.Fatalf("parts %v, errors %v", res.Parts, res.Errors)
	}
	if res.Env.Cores <= 0 || res.Env.Redis == "?" || res.Env.Postgres == "?" || res.Env.GoVersion == "" {
		t.Fatalf("header: %+v", res.Env)
	}
	mu.Lock()
	if steps == 0 || steps != finished {
		t.Errorf("%d steps started, %d finished", steps, finished)
	}
	mu.Unlock()
	b, err := json.Marshal(res)
	if err != nil {
		t.Fatal(err)
	}
	var back map[string]any
	if err := json.Unmarshal(b, &back); err != nil {
		t.Fatal(err)
	}
	for _, p := range bench.KnownParts() {
		if _, ok := back[p]; ok != (p == o.Parts[0]) {
			t.Fatalf("JSON has part %s: %v, want %v", p, ok, !ok)
		}
	}
	return res
}

func TestEnqueueSmoke(t *testing.T) {
	o := tiny(t, bench.PartEnqueue)
	rep := run(t, o).Enqueue
	methods := []string{bench.MethodAsynq, bench.MethodEnqueue, bench.MethodEnqueueTx, bench.MethodInsert}
	bulk := []string{bench.MethodEnqueueMany, bench.MethodEnqueueManyTx}
	if len(rep.Rows) != 2*len(methods)+len(bulk) {
		t.Fatalf("%d rows, want %d", len(rep.Rows), 2*len(methods)+len(bulk))
	}
	for i, row := range rep.Rows {
		method, producers, jobs := methods[i%len(methods)], 1, o.EnqueueJobs
		switch {
		case i >= 2*len(methods):
			method, jobs = bulk[i-2*len(methods)], bench.BulkRowFactor*o.EnqueueJobs
		case i >= len(methods):
			producers = o.Producers
		}
		if row.Method != method || row.Producers != producers || row.Jobs != jobs {
			t.Fatalf("row %d: %+v", i, row)
		}
		if row.JobsPerSecond <= 0 || row.Call.P50 <= 0 || row.Call.P99 < row.Call.P50 || row.Ratio <= 0 || row.ClientCPUms <= 0 {
			t.Fatalf("row %d: %+v", i, row)
		}
		// Every keel row writes ledger rows; asynq's is not measured.
		if (method != bench.MethodAsynq) != (row.WALBytes > 0) {
			t.Fatalf("row %d (%s): no WAL per job measured: %+v", i, method, row)
		}
	}
}

func TestLatencySmoke(t *testing.T) {
	o := tiny(t, bench.PartLatency)
	rep := run(t, o).Latency
	if len(rep.Rows) != 4 {
		t.Fatalf("%d rows, want 4", len(rep.Rows))
	}
	for _, row := range rep.Rows {
		if row.Samples != o.LatencySamples {
			t.Fatalf("%s: %d samples, want %d", row.Name, row.Samples, o.LatencySamples)
		}
		if l := row.Latency; l.P50 <= 0 || l.P99 < l.P50 || l.Max < l.P99 {
			t.Fatalf("%s: %+v", row.Name, l)
		}
	}
	if !strings.Contains(rep.String(), "target p99") {
		t.Fatalf("no verdict in\n%s", rep)
	}
}

func TestRelaySmoke(t *testing.T) {
	o := tiny(t, bench.PartRelay)
	rep := run(t, o).Relay
	if len(rep.Rows) != 3 || rep.EnqueueTxJobsPerSecond <= 0 {
		t.Fatalf("%+v", rep)
	}
	for _, row := range rep.Rows {
		if row.Jobs != o.RelayJobs || row.JobsPerSecond <= 0 || row.Ratio <= 0 {
			t.Fatalf("%+v", row)
		}
	}
	if rep.Rows[1].Relays != 1 || rep.Rows[2].Relays != 2 {
		t.Fatalf("relays: %+v", rep.Rows)
	}
}

func TestRecoverySmoke(t *testing.T) {
	o := tiny(t, bench.PartRecovery)
	rep := run(t, o).Recovery
	n := o.RecoveryJobs
	if rep.Ledger.Succeeded != n || rep.Ledger.NotSucceeded != 0 {
		t.Fatalf("ledger: %+v", rep.Ledger)
	}
	if rep.Republished < uint64(n) {
		t.Fatalf("reconciler republished %d of %d lost jobs", rep.Republished, n)
	}
	if rep.Seconds <= 0 || rep.DrainSeconds <= 0 {
		t.Fatalf("%+v", rep)
	}
	if rep.DefaultSeconds <= 0 || rep.DefaultRepublished < uint64(n) || rep.DefaultGraceSeconds != outbox.DefaultGrace.Seconds() {
		t.Fatalf("run with the default settings: %+v", rep)
	}
}

// A child worker holding a job is killed; another worker with the defaults
// starts the job again. The time is reported, not asserted.
func TestRedeliverySmoke(t *testing.T) {
	o := tiny(t, bench.PartRedelivery)
	rep := run(t, o).Redelivery
	if len(rep.Seconds) != 1 || rep.Seconds[0] <= 0 || rep.P50 != rep.Seconds[0] || rep.Max != rep.Seconds[0] {
		t.Fatalf("%+v", rep)
	}
	if !strings.Contains(rep.String(), "SIGKILL") {
		t.Fatalf("no kills in\n%s", rep)
	}
}

func TestMemorySmoke(t *testing.T) {
	o := tiny(t, bench.PartMemory)
	rep := run(t, o).Memory
	if rep.Skipped != "" {
		t.Skip(rep.Skipped)
	}
	if len(rep.Rows) != 2 || rep.Ratio <= 0 {
		t.Fatalf("%+v", rep)
	}
	for _, row := range rep.Rows {
		if row.IdleMiB <= 0 || row.PeakMiB < row.IdleMiB || row.MeanMiB <= 0 {
			t.Fatalf("%+v", row)
		}
	}
}

// The scale part on a private Postgres, at tiny sizes: every figure is
// there and consistent with the ledgers loaded; nothing is timed.
func TestScaleSmoke(t *testing.T) {
	if err := pgserver.Available(); err != nil {
		t.Skip(err)
	}
	o := tiny(t, bench.PartScale)
	checkScale(t, o, run(t, o).Scale)
}

// Pointed at a database, the scale part drops its schema at the end.
func TestScaleSmokeOnDatabase(t *testing.T) {
	o := tinyIn(t, bench.PartScale, "keel_bench_test_scaledb")
	o.ScaleDatabaseURL = o.DatabaseURL
	checkScale(t, o, run(t, o).Scale)
	conn, err := pgx.Connect(context.Background(), o.DatabaseURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	var left bool
	if err := conn.QueryRow(context.Background(), `SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)`,
		o.Schema+"_scale").Scan(&left); err != nil || left {
		t.Fatalf("schema %s_scale left behind (%v)", o.Schema, err)
	}
}

func checkScale(t *testing.T, o bench.Options, rep *bench.ScaleReport) {
	t.Helper()
	if rep.Small == nil || rep.Big == nil || len(rep.Settings) == 0 {
		t.Fatalf("%+v", rep)
	}
	for _, l := range []*bench.ScaleLedger{rep.Small, rep.Big} {
		if l.Open != o.ScaleOpen || l.Loaded.Rows != int64(l.Finished+l.Open) || l.Loaded.TableBytes <= 0 || len(l.Loaded.Indexes) == 0 {
			t.Fatalf("%s: %d finished, %d open, sizes %+v", l.Name, l.Finished, l.Open, l.Loaded)
		}
		if l.Worker.Jobs != o.ScaleJobs || l.Worker.JobsPerSecond <= 0 {
			t.Fatalf("%s: worker %+v", l.Name, l.Worker)
		}
		for _, lat := range []bench.Latency{l.Claim, l.Complete, l.EnqueueTx} {
			if lat.P50 <= 0 || lat.P99 < lat.P50 {
				t.Fatalf("%s: latency %+v", l.Name, lat)
			}
		}
		if l.Reconcile.Rows != o.ScaleOpen || l.Reconcile.Republished != 0 || l.Reconcile.AllocMiB <= 0 {
			t.Fatalf("%s: reconciler pass %+v", l.Name, l.Reconcile)
		}
		if len(l.Plans) != 6 {
			t.Fatalf("%s: %d plans", l.Name, len(l.Plans))
		}
		for _, p := range l.Plans {
			if len(p.Scans) == 0 {
				t.Fatalf("%s: plan %+v", l.Name, p)
			}
		}
		// A quarter of the finished jobs (less the dead ones) are past the
		// default retention.
		pruned := 0
		for _, p := range l.Prunes {
			pruned += p.Rows
		}
		if len(l.Prunes) != 2 || pruned < l.Finished*24/100 || pruned > l.Finished*26/100+1 {
			t.Fatalf("%s: pruned %d of %d finished: %+v", l.Name, pruned, l.Finished, l.Prunes)
		}
		if l.Vacuum.Vacuumed.Rows != int64(l.Finished+l.Open-pruned) {
			t.Fatalf("%s: %d rows after vacuum, want %d", l.Name, l.Vacuum.Vacuumed.Rows, l.Finished+l.Open-pruned)
		}
	}
	if rep.Big.Finished != o.ScaleFinished || rep.Small.Finished != o.ScaleFinished/bench.ScaleBaselineDivisor {
		t.Fatalf("finished: small %d, big %d", rep.Small.Finished, rep.Big.Finished)
	}
	if rep.PruneHeadroom <= 0 || !strings.Contains(rep.String(), "pruning by DELETE") {
		t.Fatalf("no verdict in\n%s", rep)
	}
}

func TestRunRefusesUnknownPart(t *testing.T) {
	o := options(t, 1)
	o.Parts = []string{"enqueue", "nonsense"}
	if _, err := bench.Run(context.Background(), o); err == nil || !strings.Contains(err.Error(), "nonsense") {
		t.Fatalf("err = %v, want an unknown part", err)
	}
}

func TestOptionsRefusePublicSchema(t *testing.T) {
	_, err := bench.Processing(context.Background(), bench.Options{Jobs: 1, Schema: "public",
		RedisAddr: testenv.RedisAddr(), RedisDB: testenv.DBBench, DatabaseURL: testenv.DatabaseURL()})
	if err == nil {
		t.Fatal("schema public accepted")
	}
}
