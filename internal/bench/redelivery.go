package bench

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/hibiken/asynq"

	"github.com/keeljobs/keel/internal/executor"
	"github.com/keeljobs/keel/internal/ledger"
	"github.com/keeljobs/keel/outbox"
	"github.com/keeljobs/keel/server"
)

// RedeliveryTarget is how soon after its worker was killed keel aims to
// start a job again, with the default settings.
const RedeliveryTarget = 15 * time.Second

// WorkerKeelHold is the child worker of the redelivery part: a keel worker
// with the default settings whose handler holds every job until it is
// killed.
const WorkerKeelHold = "keel-hold"

// RedeliveryReport is the redelivery part's result.
type RedeliveryReport struct {
	Kills int `json:"kills"`
	// Seconds holds, per kill, the time from SIGKILL to the job's next
	// start on the other worker.
	Seconds []float64 `json:"seconds"`
	P50     float64   `json:"p50_seconds"`
	Max     float64   `json:"max_seconds"`
	// The defaults that decide it.
	LeaseSeconds  float64 `json:"lease_seconds"`
	RescueSeconds float64 `json:"rescue_interval_seconds"`
	TargetSeconds float64 `json:"target_seconds"`
	MetTarget     bool    `json:"met_target"`
}

// String renders the report.
func (r RedeliveryReport) String() string {
	var sb strings.Builder
	fmt.Fprintf(&sb, "a child keel worker (default settings) holds a job and is killed with SIGKILL; another keel worker\n"+
		"(default settings: ledger lease %gs, rescuer every %gs) starts the job again; %d kills\n\n",
		r.LeaseSeconds, r.RescueSeconds, r.Kills)
	parts := make([]string, len(r.Seconds))
	for i, s := range r.Seconds {
		parts[i] = fmt.Sprintf("%.1f", s)
	}
	fmt.Fprintf(&sb, "SIGKILL → next start, seconds: %s\n", strings.Join(parts, ", "))
	verdict := "met"
	if !r.MetTarget {
		verdict = "NOT met"
	}
	fmt.Fprintf(&sb, "p50 %.1fs, max %.1fs; target ≤ %gs: %s (asynq alone: 61–92s)\n", r.P50, r.Max, r.TargetSeconds, verdict)
	return sb.String()
}

func (e *env) redelivery(ctx context.Context) (RedeliveryReport, error) {
	o := e.o
	rep := RedeliveryReport{Kills: o.RedeliveryKills, LeaseSeconds: executor.DefaultLease.Seconds(),
		RescueSeconds: outbox.DefaultRescueInterval.Seconds(), TargetSeconds: RedeliveryTarget.Seconds()}
	if len(o.WorkerCommand) == 0 {
		return rep, errors.New("no command to start a child worker with (Options.WorkerCommand)")
	}
	var done atomic.Int64
	finish := e.step("kill -9 → next start", o.RedeliveryKills, func() int { return int(done.Load()) })
	defer finish()
	for range o.RedeliveryKills {
		took, err := e.killOnce(ctx)
		if err != nil {
			return rep, err
		}
		rep.Seconds = append(rep.Seconds, took.Seconds())
		done.Add(1)
	}
	sorted := slices.Clone(rep.Seconds)
	slices.Sort(sorted)
	rep.P50, rep.Max = sorted[(len(sorted)-1)/2], sorted[len(sorted)-1]
	rep.MetTarget = rep.Max <= rep.TargetSeconds
	return rep, nil
}

// killOnce lets a child worker claim one job, starts a second worker,
// kills the child and returns how long the job took to start again.
func (e *env) killOnce(ctx context.Context) (time.Duration, error) {
	o := e.o
	ctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	if err := e.reset(ctx); err != nil {
		return 0, err
	}
	spec, err := json.Marshal(workerSpec{Worker: WorkerKeelHold, RedisAddr: o.RedisAddr, RedisDB: o.RedisDB,
		RedisPassword: o.RedisPassword, DatabaseURL: o.DatabaseURL, Schema: o.Schema, Concurrency: 1})
	if err != nil {
		return 0, err
	}
	child, err := startChild(ctx, o.WorkerCommand, string(spec))
	if err != nil {
		return 0, err
	}
	defer child.stop() //nolint:errcheck // killed below
	if err := e.prefillKeel(ctx, e.redis, 1); err != nil {
		return 0, err
	}
	if err := e.waitLedger(ctx, ledger.RunningJobs, child.exited); err != nil {
		return 0, fmt.Errorf("the child never claimed the job: %w (%s)", err, child.output())
	}

	started := make(chan time.Time, 1)
	h := asynq.HandlerFunc(func(context.Context, *asynq.Task) error {
		select {
		case started <- time.Now():
		default:
		}
		return nil
	})
	srv, err := server.New(server.Config{Redis: e.redis, Pool: e.pool, Logger: e.warn}, h)
	if err != nil {
		return 0, err
	}
	w := startServer(srv)
	defer w.stop() //nolint:errcheck // a failed stop shows in the next part

	if err := child.cmd.Process.Kill(); err != nil {
		return 0, err
	}
	killed := time.Now()
	<-child.exited
	select {
	case at := <-started:
		if err := e.waitLedger(ctx, ledger.SucceededJobs, nil); err != nil {
			return 0, err
		}
		return at.Sub(killed), nil
	case err := <-w.stopped:
		return 0, fmt.Errorf("worker stopped early: %v", err)
	case <-ctx.Done():
		return 0, fmt.Errorf("the job did not start again within 2 minutes of the kill: %w", ctx.Err())
	}
}

// waitLedger polls count until it says 1.
func (e *env) waitLedger(ctx context.Context, count func(context.Context, ledger.DB) (int, error), exited <-chan struct{}) error {
	for {
		n, err := count(ctx, e.pool)
		if err != nil {
			return err
		}
		if n == 1 {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-exited:
			return errors.New("child worker exited")
		case <-time.After(10 * time.Millisecond):
		}
	}
}
