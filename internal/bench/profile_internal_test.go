package bench

import (
	"context"
	"flag"
	"os"
	"runtime"
	"runtime/pprof"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/keeljobs/keel/internal/testenv"
	"github.com/keeljobs/keel/server"
)

var (
	profWorker = flag.String("keel.profile", "", "TestProfileProcessing: which worker to profile, asynq or keel")
	profOut    = flag.String("keel.profile.out", "", "TestProfileProcessing: where to write the CPU profile")
	profMem    = flag.String("keel.profile.mem", "", "TestProfileProcessing: where to write the allocation profile")
	profJobs   = flag.Int("keel.profile.jobs", 20000, "TestProfileProcessing: no-op jobs to process")
)

// TestProfileProcessing runs one worker of the processing part, plain asynq
// or keel, over a prefilled backlog of no-op jobs, with a CPU profile around
// the processing only (not the prefill), and logs the worker process's heap
// allocations per job. CPU profiles and allocation counts hold on a busy
// host where wall-clock ratios do not:
//
//	go test -run TestProfileProcessing ./internal/bench/ -args -keel.profile=keel -keel.profile.out=keel.pprof
//	go tool pprof -top keel.pprof
func TestProfileProcessing(t *testing.T) {
	if *profWorker == "" {
		t.Skip("set -keel.profile=asynq or -keel.profile=keel")
	}
	ctx := context.Background()
	r := testenv.Redis(t, testenv.DBBench) // flushed: the queues start empty
	if _, err := testenv.PoolConfig(ctx, "keel_bench_profile"); err != nil {
		t.Fatal(err)
	}
	o := Options{Jobs: *profJobs, RedisAddr: r.Addr, RedisDB: r.DB,
		DatabaseURL: testenv.DatabaseURL(), Schema: "keel_bench_profile"}.withDefaults()
	e, err := open(ctx, o)
	if err != nil {
		t.Fatal(err)
	}
	defer e.close()
	n := o.Jobs
	c := newCounter(n)
	var start func() error
	var stop func()
	switch *profWorker {
	case "asynq":
		if err := e.prefillPlain(ctx, e.redis, n); err != nil {
			t.Fatal(err)
		}
		srv := asynq.NewServer(e.redis, asynq.Config{Concurrency: o.Concurrency, Queues: Queues(),
			TaskCheckInterval: o.Poll, Logger: quietAsynq{o.Logger}, LogLevel: asynq.WarnLevel})
		start = func() error { return srv.Start(c) }
		stop = srv.Shutdown
	case "keel":
		if err := e.truncate(ctx); err != nil {
			t.Fatal(err)
		}
		if err := e.prefillKeel(ctx, e.redis, n); err != nil {
			t.Fatal(err)
		}
		srv, err := server.New(server.Config{Redis: e.redis, Pool: e.pool, Queues: Queues(),
			Concurrency: o.Concurrency, Logger: e.warn}, c)
		if err != nil {
			t.Fatal(err)
		}
		var w *running
		start = func() error { w = startServer(srv); return nil }
		stop = func() {
			if err := w.stop(); err != nil {
				t.Error(err)
			}
		}
	default:
		t.Fatalf("unknown worker %q", *profWorker)
	}
	if *profOut != "" {
		f, err := os.Create(*profOut)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			t.Fatal(err)
		}
	}
	if *profMem != "" {
		runtime.MemProfileRate = 4096
	}
	runtime.GC()
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	t0 := time.Now()
	if err := start(); err != nil {
		t.Fatal(err)
	}
	select {
	case <-c.all:
	case <-time.After(o.timeout(n)):
		t.Fatalf("%d of %d jobs after %s", c.done(), n, o.timeout(n))
	}
	d := time.Since(t0)
	runtime.ReadMemStats(&after)
	if *profOut != "" {
		pprof.StopCPUProfile()
	}
	if *profMem != "" {
		f, err := os.Create(*profMem)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		if err := pprof.Lookup("allocs").WriteTo(f, 0); err != nil {
			t.Fatal(err)
		}
	}
	stop()
	t.Logf("%s: %d jobs in %s; %.0f allocs/job, %.0f B/job, %d GCs",
		*profWorker, n, d.Round(time.Millisecond),
		float64(after.Mallocs-before.Mallocs)/float64(n),
		float64(after.TotalAlloc-before.TotalAlloc)/float64(n), after.NumGC-before.NumGC)
}
