package bench_test

import (
	"context"
	"flag"
	"log/slog"
	"os"
	"testing"

	"github.com/keeljobs/keel/bench"
	"github.com/keeljobs/keel/internal/testenv"
)

var (
	jobs   = flag.Int("keel.jobs", bench.DefaultJobs, "jobs per worker in BenchmarkLedgerVsPlain")
	rounds = flag.Int("keel.rounds", 1, "rounds (plain then keel) in BenchmarkLedgerVsPlain; the median ratio's round is reported")
)

func options(tb testing.TB, n int) bench.Options {
	r := testenv.Redis(tb, testenv.DBBench) // flushed: the queues start empty
	return bench.Options{
		Jobs:        n,
		RedisAddr:   r.Addr,
		RedisDB:     r.DB,
		DatabaseURL: testenv.DatabaseURL(),
		Schema:      "keel_bench",
	}
}

// BenchmarkLedgerVsPlain measures no-op jobs per second on plain Asynq and
// on a keel worker, and the ratio between them:
//
//	go test -run XXX -bench LedgerVsPlain -benchtime 1x ./bench/
//	go test -run XXX -bench LedgerVsPlain -benchtime 1x ./bench/ -args -keel.rounds=3
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
	rep, err := bench.Processing(context.Background(), options(t, n))
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
}

func TestOptionsRefusePublicSchema(t *testing.T) {
	_, err := bench.Processing(context.Background(), bench.Options{Jobs: 1, Schema: "public",
		RedisAddr: testenv.RedisAddr(), RedisDB: testenv.DBBench, DatabaseURL: testenv.DatabaseURL()})
	if err == nil {
		t.Fatal("schema public accepted")
	}
}
