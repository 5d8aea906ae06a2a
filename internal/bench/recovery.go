package bench

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/keeljobs/keel/internal/executor"
	"github.com/keeljobs/keel/internal/ledger"
	"github.com/keeljobs/keel/outbox"
	"github.com/keeljobs/keel/server"
)

// RecoveryTarget is how soon after Redis lost them keel aims to have run
// 10,000 accepted jobs, with its default settings.
const RecoveryTarget = 30 * time.Second

// RecoveryReport is the recovery part's result.
type RecoveryReport struct {
	Jobs int `json:"jobs"`
	// The reconciler's settings.
	IntervalSeconds float64 `json:"interval_seconds"`
	GraceSeconds    float64 `json:"grace_seconds"`
	// DrainSeconds is how long the same worker and reconciler took to run
	// as many jobs that Redis still held: the baseline.
	DrainSeconds float64 `json:"drain_seconds"`
	// Seconds is from FLUSHALL until the ledger recorded every job as
	// succeeded.
	Seconds float64 `json:"seconds"`
	// Ratio is Seconds over DrainSeconds.
	Ratio float64 `json:"ratio_to_drain"`
	// Republished is how many jobs the reconciler published again.
	Republished uint64 `json:"republished"`
	// What the ledger and the guard say of the recovered jobs.
	Ledger LedgerCheck `json:"ledger"`
	// The same loss healed by a worker with keel's default reconciler
	// settings (outbox.DefaultReconcileInterval and DefaultGrace): what a
	// user gets without tuning.
	DefaultIntervalSeconds float64 `json:"default_interval_seconds"`
	DefaultGraceSeconds    float64 `json:"default_grace_seconds"`
	DefaultSeconds         float64 `json:"default_seconds"`
	DefaultRepublished     uint64  `json:"default_republished"`
	// TargetSeconds is RecoveryTarget, for 10,000 jobs; MetTarget is
	// whether the run with the defaults met it.
	TargetSeconds float64 `json:"target_seconds"`
	MetTarget     bool    `json:"met_target"`
}

// String renders the report as a table.
func (r RecoveryReport) String() string {
	var sb strings.Builder
	fmt.Fprintf(&sb, "%d jobs accepted and published to a private Redis, which is then FLUSHALL'd; a worker and a reconciler\n"+
		"(interval %gs, grace %gs) start; plain asynq would have lost every one of them\n\n", r.Jobs, r.IntervalSeconds, r.GraceSeconds)
	tw := tabwriter.NewWriter(&sb, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "run\tjobs\tseconds\tjobs/s\tvs drain\t")
	fmt.Fprintf(tw, "drain: Redis intact\t%d\t%.2f\t%.0f\t1.00\t\n", r.Jobs, r.DrainSeconds, float64(r.Jobs)/r.DrainSeconds)
	fmt.Fprintf(tw, "recovery: Redis flushed\t%d\t%.2f\t%.0f\t%.2f\t\n", r.Jobs, r.Seconds, float64(r.Jobs)/r.Seconds, r.Ratio)
	if r.DefaultSeconds > 0 {
		fmt.Fprintf(tw, "recovery, default settings (interval %gs, grace %gs)\t%d\t%.2f\t%.0f\t%.2f\t\n", r.DefaultIntervalSeconds,
			r.DefaultGraceSeconds, r.Jobs, r.DefaultSeconds, float64(r.Jobs)/r.DefaultSeconds, ratio(r.DefaultSeconds, r.DrainSeconds))
	}
	tw.Flush()
	verdict := "met"
	if !r.MetTarget {
		verdict = "NOT met"
	}
	fmt.Fprintf(&sb, "\nreconciler republished %d; ledger: %d succeeded, %d not, %d attempts; guard: %d duplicates skipped\n",
		r.Republished, r.Ledger.Succeeded, r.Ledger.NotSucceeded, r.Ledger.Attempts, r.Ledger.DuplicatesSkipped)
	fmt.Fprintf(&sb, "target, default settings: up to 10,000 lost jobs all run within %gs of the flush: %s\n",
		r.TargetSeconds, verdict)
	return sb.String()
}

func (e *env) recovery(ctx context.Context) (RecoveryReport, error) {
	o := e.o
	n := o.RecoveryJobs
	rep := RecoveryReport{Jobs: n, IntervalSeconds: o.RecoveryInterval.Seconds(), GraceSeconds: o.RecoveryGrace.Seconds(),
		DefaultIntervalSeconds: outbox.DefaultReconcileInterval.Seconds(), DefaultGraceSeconds: outbox.DefaultGrace.Seconds(),
		TargetSeconds: RecoveryTarget.Seconds()}
	fast := outbox.ReconcilerConfig{Interval: o.RecoveryInterval, Grace: o.RecoveryGrace}
	rs, err := startRedis(ctx, o.RedisServer)
	if err != nil {
		return rep, err
	}
	defer rs.stop()
	r := asynq.RedisClientOpt{Addr: rs.addr}
	ctx, cancel := context.WithTimeout(ctx, o.timeout(5*n))
	defer cancel()

	// The baseline: the same worker runs n jobs Redis holds.
	if err := e.truncate(ctx); err != nil {
		return rep, err
	}
	if err := e.prefillKeel(ctx, r, n); err != nil {
		return rep, err
	}
	drain, _, err := e.runRecoveryWorker(ctx, r, n, "drain, Redis intact", fast)
	rep.DrainSeconds = drain.Seconds()
	if err != nil {
		return rep, fmt.Errorf("drain: %w", err)
	}

	took, st, err := e.lose(ctx, rs, r, n, "after FLUSHALL", fast)
	rep.Seconds = took.Seconds()
	rep.Ratio = ratio(rep.Seconds, rep.DrainSeconds)
	rep.Republished = st.recon.Republished
	rep.Ledger.Claimed, rep.Ledger.DuplicatesSkipped = st.guard.Claimed, st.guard.DuplicatesSkipped
	rep.Ledger.LeaseBusy, rep.Ledger.LedgerErrors = st.guard.LeaseBusy, st.guard.LedgerErrors
	if err != nil {
		return rep, fmt.Errorf("recovery: %w", err)
	}
	if rep.Ledger, err = ledgerCheck(ctx, e.pool, rep.Ledger); err != nil {
		return rep, err
	}
	if rep.Ledger.Succeeded != n || rep.Ledger.NotSucceeded != 0 {
		return rep, fmt.Errorf("ledger check failed: %d of %d jobs succeeded, %d not", rep.Ledger.Succeeded, n, rep.Ledger.NotSucceeded)
	}

	took, st, err = e.lose(ctx, rs, r, n, "after FLUSHALL, default settings", outbox.ReconcilerConfig{})
	rep.DefaultSeconds, rep.DefaultRepublished = took.Seconds(), st.recon.Republished
	if err != nil {
		return rep, fmt.Errorf("recovery with the defaults: %w", err)
	}
	lc, err := ledgerCheck(ctx, e.pool, LedgerCheck{})
	if err != nil {
		return rep, err
	}
	if lc.Succeeded != n || lc.NotSucceeded != 0 {
		return rep, fmt.Errorf("ledger check with the defaults failed: %d of %d jobs succeeded, %d not", lc.Succeeded, n, lc.NotSucceeded)
	}
	// The grace and the interval are fixed costs, so the target does not
	// shrink with fewer jobs.
	rep.MetTarget = n <= 10000 && took <= RecoveryTarget
	return rep, nil
}

// lose puts n accepted jobs in Redis, empties it and runs a worker and a
// reconciler with cfg until the ledger records every job as succeeded.
func (e *env) lose(ctx context.Context, rs *redisProcess, r asynq.RedisClientOpt, n int, step string,
	cfg outbox.ReconcilerConfig) (time.Duration, recoveryStats, error) {
	if err := e.truncate(ctx); err != nil {
		return 0, recoveryStats{}, err
	}
	if err := rs.flush(ctx); err != nil {
		return 0, recoveryStats{}, err
	}
	if err := e.prefillKeel(ctx, r, n); err != nil {
		return 0, recoveryStats{}, err
	}
	if err := rs.flush(ctx); err != nil {
		return 0, recoveryStats{}, err
	}
	return e.runRecoveryWorker(ctx, r, n, step, cfg)
}

type recoveryStats struct {
	guard executor.GuardStats
	recon outbox.ReconcileStats
}

// runRecoveryWorker runs a keel worker and a reconciler on r until the
// ledger records n jobs as succeeded, and returns how long that took.
func (e *env) runRecoveryWorker(ctx context.Context, r asynq.RedisClientOpt, n int, step string,
	cfg outbox.ReconcilerConfig) (time.Duration, recoveryStats, error) {
	var st recoveryStats
	// The reconciler warns once per job it republishes; those lines are the
	// expected outcome here, not news.
	quiet := slog.New(levelAtLeast{e.o.Logger.Handler(), slog.LevelError})
	c := newCounter(n)
	srv, err := server.New(server.Config{Redis: r, Pool: e.pool, Queues: Queues(), Concurrency: e.o.Concurrency,
		DisableReconciler: true, Logger: quiet}, c)
	if err != nil {
		return 0, st, err
	}
	cfg.Pool, cfg.Redis, cfg.Logger = e.pool, r, quiet
	recon, err := outbox.NewReconciler(cfg)
	if err != nil {
		srv.Close()
		return 0, st, err
	}
	defer recon.Close()
	finish := e.step(step, n, c.done)
	rctx, stopRecon := context.WithCancel(ctx)
	var wg sync.WaitGroup
	start := time.Now()
	w := startServer(srv)
	wg.Go(func() { _ = recon.Run(rctx) })
	err = e.waitSucceeded(ctx, c, n, w.stopped)
	took := time.Since(start)
	finish()
	stopRecon()
	wg.Wait()
	err = errors.Join(err, w.stop())
	st.guard = srv.GuardStats()
	st.recon = recon.Stats()
	return took, st, err
}

// waitSucceeded returns when the ledger records n jobs of Kind as
// succeeded. It polls slowly until the handler has run n times, then
// closely.
func (e *env) waitSucceeded(ctx context.Context, c *counter, n int, stopped <-chan error) error {
	interval := 250 * time.Millisecond
	all := c.all
	for {
		select {
		case err := <-stopped:
			if err == nil {
				err = errors.New("worker stopped early")
			}
			return err
		case <-ctx.Done():
			return fmt.Errorf("%d handler runs: %w", c.done(), ctx.Err())
		case <-all:
			all = nil
			interval = 5 * time.Millisecond
		case <-time.After(interval):
		}
		succeeded, err := ledger.SucceededOfKind(ctx, e.pool, Kind)
		if err != nil {
			return err
		}
		if succeeded >= n {
			return nil
		}
	}
}

// redisProcess is a private redis-server without persistence.
type redisProcess struct {
	cmd    *exec.Cmd
	addr   string
	output bytes.Buffer
	exited chan struct{}
}

// startRedis starts program (a redis-server) on a free loopback port and
// waits until it answers.
func startRedis(ctx context.Context, program string) (*redisProcess, error) {
	path, err := exec.LookPath(program)
	if err != nil {
		return nil, fmt.Errorf("a private Redis is needed (the shared one is never flushed): %w", err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	port := l.Addr().(*net.TCPAddr).Port
	l.Close()
	p := &redisProcess{addr: net.JoinHostPort("127.0.0.1", strconv.Itoa(port))}
	p.cmd = exec.Command(path, "--port", strconv.Itoa(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
		"--daemonize", "no", "--loglevel", "warning")
	p.cmd.Stdout, p.cmd.Stderr = &p.output, &p.output
	if err := p.cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", path, err)
	}
	p.exited = make(chan struct{})
	go func() {
		_ = p.cmd.Wait()
		close(p.exited)
	}()
	rc := redis.NewClient(&redis.Options{Addr: p.addr})
	defer rc.Close()
	deadline := time.Now().Add(10 * time.Second)
	for {
		if rc.Ping(ctx).Err() == nil {
			return p, nil
		}
		select {
		case <-p.exited:
			return nil, fmt.Errorf("%s on port %d exited: %s", path, port, strings.TrimSpace(p.output.String()))
		case <-time.After(20 * time.Millisecond):
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			p.stop()
			return nil, fmt.Errorf("%s on port %d does not answer", path, port)
		}
	}
}

// flush empties the private Redis.
func (p *redisProcess) flush(ctx context.Context) error {
	rc := redis.NewClient(&redis.Options{Addr: p.addr})
	defer rc.Close()
	return rc.FlushAll(ctx).Err()
}

// stop kills the server; it kept nothing on disk.
func (p *redisProcess) stop() {
	_ = p.cmd.Process.Kill()
	<-p.exited
}
