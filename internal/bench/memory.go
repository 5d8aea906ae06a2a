package bench

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/hibiken/asynq"

	"github.com/keeljobs/keel/server"
)

// WorkerEnv is the environment variable through which the memory part
// hands a child worker its settings (see ServeWorker).
const WorkerEnv = "KEEL_BENCH_WORKER"

// The memory part's workers.
const (
	WorkerAsynq = "asynq"
	WorkerKeel  = "keel"
)

// MemoryRow is the resident size of one worker process.
type MemoryRow struct {
	Worker      string `json:"worker"`
	Concurrency int    `json:"concurrency"`
	Jobs        int    `json:"jobs"`
	// IdleMiB is the resident size once started, before any job.
	IdleMiB float64 `json:"idle_rss_mib"`
	// MeanMiB is its mean while the worker processed the backlog, PeakMiB
	// the most it ever was (the kernel's high-water mark, VmHWM).
	MeanMiB float64 `json:"mean_rss_mib"`
	PeakMiB float64 `json:"peak_rss_mib"`
}

// MemoryReport is the memory part's result.
type MemoryReport struct {
	Rows []MemoryRow `json:"rows"`
	// Ratio is keel's peak over plain asynq's.
	Ratio float64 `json:"ratio"`
	// Skipped says why nothing was measured, when so.
	Skipped string `json:"skipped,omitempty"`
}

// String renders the report as a table.
func (r MemoryReport) String() string {
	var sb strings.Builder
	if r.Skipped != "" {
		fmt.Fprintf(&sb, "skipped: %s\n", r.Skipped)
		return sb.String()
	}
	if len(r.Rows) > 0 {
		fmt.Fprintf(&sb, "each worker runs in a child process with a no-op handler and processes a backlog of %d jobs at concurrency %d\n\n",
			r.Rows[0].Jobs, r.Rows[0].Concurrency)
	}
	tw := tabwriter.NewWriter(&sb, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "worker\tidle MiB\tmean MiB\tpeak MiB\t")
	for _, row := range r.Rows {
		fmt.Fprintf(tw, "%s\t%.1f\t%.1f\t%.1f\t\n", row.Worker, row.IdleMiB, row.MeanMiB, row.PeakMiB)
	}
	tw.Flush()
	fmt.Fprintf(&sb, "\npeak ratio keel/asynq: %.2f (the keel worker includes its relay and reconciler)\n", r.Ratio)
	return sb.String()
}

// workerSpec is what a child worker is told through WorkerEnv.
type workerSpec struct {
	Worker        string `json:"worker"`
	RedisAddr     string `json:"redis_addr"`
	RedisDB       int    `json:"redis_db"`
	RedisPassword string `json:"redis_password,omitempty"`
	DatabaseURL   string `json:"database_url,omitempty"`
	Schema        string `json:"schema,omitempty"`
	Concurrency   int    `json:"concurrency"`
}

func (e *env) memory(ctx context.Context) (MemoryReport, error) {
	var rep MemoryReport
	if len(e.o.WorkerCommand) == 0 {
		rep.Skipped = "no command to start a child worker with (Options.WorkerCommand)"
		return rep, nil
	}
	if _, err := os.Stat("/proc/self/status"); err != nil {
		rep.Skipped = "no /proc to read a process's resident size from"
		return rep, nil
	}
	for _, w := range []string{WorkerAsynq, WorkerKeel} {
		if err := e.reset(ctx); err != nil {
			return rep, err
		}
		row, err := e.measureWorker(ctx, w)
		rep.Rows = append(rep.Rows, row)
		if err != nil {
			return rep, fmt.Errorf("%s worker: %w", w, err)
		}
	}
	rep.Ratio = ratio(rep.Rows[1].PeakMiB, rep.Rows[0].PeakMiB)
	return rep, nil
}

// measureWorker starts a child worker on a paused queue, reads its idle
// size, fills the queue, resumes it and follows the child's size until the
// backlog is gone.
func (e *env) measureWorker(ctx context.Context, worker string) (MemoryRow, error) {
	o := e.o
	n := o.MemoryJobs
	row := MemoryRow{Worker: worker, Concurrency: o.MemoryConcurrency, Jobs: n}
	ctx, cancel := context.WithTimeout(ctx, o.timeout(2*n))
	defer cancel()
	insp := asynq.NewInspector(e.redis)
	defer insp.Close()
	if err := insp.PauseQueue(Queue); err != nil {
		return row, err
	}
	defer insp.UnpauseQueue(Queue) //nolint:errcheck // unpaused below unless a step failed

	spec, err := json.Marshal(workerSpec{Worker: worker, RedisAddr: o.RedisAddr, RedisDB: o.RedisDB,
		RedisPassword: o.RedisPassword, DatabaseURL: o.DatabaseURL, Schema: o.Schema, Concurrency: o.MemoryConcurrency})
	if err != nil {
		return row, err
	}
	child, err := startChild(ctx, o.WorkerCommand, string(spec))
	if err != nil {
		return row, err
	}
	defer child.stop()
	time.Sleep(300 * time.Millisecond) // let start-up settle
	idle, _, err := rss(child.pid())
	if err != nil {
		return row, err
	}
	row.IdleMiB = idle

	if worker == WorkerKeel {
		err = e.prefillKeel(ctx, e.redis, n)
	} else {
		err = e.prefillPlain(ctx, e.redis, n)
	}
	if err != nil {
		return row, err
	}
	var left sync.Mutex
	remaining := n
	finish := e.step(worker+" worker, concurrency "+strconv.Itoa(o.MemoryConcurrency), n, func() int {
		left.Lock()
		defer left.Unlock()
		return n - remaining
	})
	defer finish()
	if err := insp.UnpauseQueue(Queue); err != nil {
		return row, err
	}
	var sum float64
	var samples int
	for {
		cur, _, err := rss(child.pid())
		if err != nil {
			return row, fmt.Errorf("%w (child output: %s)", err, child.output())
		}
		sum += cur
		samples++
		info, err := insp.GetQueueInfo(Queue)
		if err != nil {
			return row, err
		}
		left.Lock()
		remaining = info.Size
		left.Unlock()
		if info.Size == 0 && info.Active == 0 {
			break
		}
		select {
		case <-ctx.Done():
			return row, fmt.Errorf("%d jobs left: %w", info.Size, ctx.Err())
		case <-child.exited:
			return row, fmt.Errorf("child worker exited: %s", child.output())
		case <-time.After(20 * time.Millisecond):
		}
	}
	row.MeanMiB = sum / float64(samples)
	_, row.PeakMiB, err = rss(child.pid())
	if err != nil {
		return row, err
	}
	if err := child.stop(); err != nil {
		return row, err
	}
	if worker == WorkerKeel {
		lc, err := ledgerCheck(ctx, e.pool, LedgerCheck{})
		if err != nil {
			return row, err
		}
		if lc.Succeeded != n {
			return row, fmt.Errorf("ledger check failed: %d of %d jobs succeeded", lc.Succeeded, n)
		}
	}
	return row, nil
}

// rss reads a process's resident size and its high-water mark, in MiB.
func rss(pid int) (cur, peak float64, err error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		return 0, 0, err
	}
	for line := range strings.SplitSeq(string(b), "\n") {
		k, v, ok := strings.Cut(line, ":")
		if !ok || (k != "VmRSS" && k != "VmHWM") {
			continue
		}
		f := strings.Fields(v)
		if len(f) != 2 || f[1] != "kB" {
			return 0, 0, fmt.Errorf("unexpected %s line %q", k, line)
		}
		kb, err := strconv.ParseFloat(f[0], 64)
		if err != nil {
			return 0, 0, err
		}
		if k == "VmRSS" {
			cur = kb / 1024
		} else {
			peak = kb / 1024
		}
	}
	if cur == 0 || peak == 0 {
		return 0, 0, fmt.Errorf("no VmRSS/VmHWM in /proc/%d/status", pid)
	}
	return cur, peak, nil
}

// childWorker is a worker process started by the memory part.
type childWorker struct {
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	out    *lockedBuffer
	exited chan struct{}
	once   sync.Once
	err    error
}

// startChild starts argv with spec in WorkerEnv and waits for its "ready".
func startChild(ctx context.Context, argv []string, spec string) (*childWorker, error) {
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Env = append(os.Environ(), WorkerEnv+"="+spec)
	c := &childWorker{cmd: cmd, out: &lockedBuffer{}, exited: make(chan struct{})}
	cmd.Stderr = c.out
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if c.stdin, err = cmd.StdinPipe(); err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start child worker %s: %w", argv[0], err)
	}
	ready := make(chan struct{})
	go func() {
		sc := bufio.NewScanner(stdout)
		signalled := false
		for sc.Scan() {
			if !signalled && sc.Text() == "ready" {
				close(ready)
				signalled = true
			}
		}
		c.err = cmd.Wait()
		close(c.exited)
	}()
	select {
	case <-ready:
		return c, nil
	case <-c.exited:
		return nil, fmt.Errorf("child worker exited before it was ready (%v): %s", c.err, c.output())
	case <-ctx.Done():
		c.stop()
		return nil, ctx.Err()
	case <-time.After(30 * time.Second):
		c.stop()
		return nil, fmt.Errorf("child worker not ready after 30s: %s", c.output())
	}
}

func (c *childWorker) pid() int { return c.cmd.Process.Pid }

func (c *childWorker) output() string {
	s := strings.TrimSpace(c.out.String())
	if len(s) > 2000 {
		s = "…" + s[len(s)-2000:]
	}
	return s
}

// stop asks the child to stop (by closing its stdin), and kills it if it
// has not exited within 30s.
func (c *childWorker) stop() error {
	var err error
	c.once.Do(func() {
		c.stdin.Close()
		select {
		case <-c.exited:
			if c.err != nil {
				err = fmt.Errorf("child worker: %w: %s", c.err, c.output())
			}
		case <-time.After(30 * time.Second):
			_ = c.cmd.Process.Kill()
			<-c.exited
			err = fmt.Errorf("child worker did not stop within 30s: %s", c.output())
		}
	})
	return err
}

// lockedBuffer is a bytes.Buffer safe for a writer and readers at once.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// ServeWorker runs the worker the memory part asks for in WorkerEnv: a
// plain asynq worker or a keel worker (server.New, with its relay and
// reconciler) whose handler does nothing. It prints "ready" on stdout once
// the worker runs and returns when stdin closes or ctx ends. Programs that
// pass their own command as Options.WorkerCommand call it when WorkerEnv is
// set (`keel bench` has a hidden `bench worker` command for it).
func ServeWorker(ctx context.Context) error {
	raw := os.Getenv(WorkerEnv)
	if raw == "" {
		return fmt.Errorf("keel bench: %s is not set; this command is started by the benchmark's memory part", WorkerEnv)
	}
	var spec workerSpec
	if err := json.Unmarshal([]byte(raw), &spec); err != nil {
		return fmt.Errorf("keel bench: %s: %w", WorkerEnv, err)
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		_, _ = io.Copy(io.Discard, os.Stdin)
		cancel()
	}()
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	r := asynq.RedisClientOpt{Addr: spec.RedisAddr, DB: spec.RedisDB, Password: spec.RedisPassword}
	noop := asynq.HandlerFunc(func(context.Context, *asynq.Task) error { return nil })
	switch spec.Worker {
	case WorkerAsynq:
		srv := asynq.NewServer(r, asynq.Config{Concurrency: spec.Concurrency, Queues: Queues(),
			TaskCheckInterval: server.DefaultPollingTaskCheckInterval, // as a polling worker's
			Logger:            quietAsynq{log}, LogLevel: asynq.WarnLevel})
		if err := srv.Start(noop); err != nil {
			return err
		}
		fmt.Println("ready")
		<-ctx.Done()
		srv.Shutdown()
		return nil
	case WorkerKeel, WorkerKeelHold:
		pool, err := schemaPool(ctx, spec.DatabaseURL, spec.Schema, 20)
		if err != nil {
			return err
		}
		defer pool.Close()
		cfg, h := server.Config{Redis: r, Pool: pool, Queues: Queues(), Concurrency: spec.Concurrency, Logger: log}, noop
		if spec.Worker == WorkerKeelHold {
			// keel's defaults; the handler holds its job until the process dies.
			cfg = server.Config{Redis: r, Pool: pool, Logger: log}
			h = asynq.HandlerFunc(func(ctx context.Context, _ *asynq.Task) error {
				<-ctx.Done()
				return ctx.Err()
			})
		}
		srv, err := server.New(cfg, h)
		if err != nil {
			return err
		}
		w := startServer(srv)
		fmt.Println("ready")
		select {
		case <-ctx.Done():
		case err := <-w.stopped:
			return errors.Join(errors.New("keel worker stopped early"), err)
		}
		return w.stop()
	}
	return fmt.Errorf("keel bench: unknown worker %q", spec.Worker)
}
