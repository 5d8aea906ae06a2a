package bench

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync/atomic"
	"text/tabwriter"
	"time"

	"github.com/hibiken/asynq"

	"github.com/keeljobs/keel/outbox"
	"github.com/keeljobs/keel/server"
	"github.com/keeljobs/keel/tasks"
)

// LatencyTargetP99 is the p99 from EnqueueTx's commit to the handler's
// start that keel aims at on an idle worker.
const LatencyTargetP99 = 50 * time.Millisecond

// LatencyRow is one way of handing jobs to an idle worker, timed.
type LatencyRow struct {
	Name string `json:"name"`
	// From is the moment the clock starts (a commit, an enqueue call); it
	// stops when the handler starts.
	From string `json:"from"`
	// PollMs is Asynq's TaskCheckInterval: an idle worker looks at its
	// queues that often (with jitter: it sleeps ½ to 1½ of it).
	PollMs  float64 `json:"poll_ms"`
	Samples int     `json:"samples"`
	Latency Latency `json:"latency"`
	// P50Ratio and P99Ratio compare the row with plain asynq polling as
	// often (the baseline row).
	P50Ratio float64 `json:"p50_ratio_to_asynq"`
	P99Ratio float64 `json:"p99_ratio_to_asynq"`
	// LeaseBusy is how many deliveries the ledger guard found locked or
	// leased and put off (asynq retries each about a second later).
	LeaseBusy uint64 `json:"lease_busy,omitempty"`
}

// LatencyReport is the latency part's result.
type LatencyReport struct {
	Samples int          `json:"samples"`
	PauseMs float64      `json:"pause_ms"`
	Rows    []LatencyRow `json:"rows"`
	// TargetP99Ms is LatencyTargetP99; MetTarget tells whether the keel
	// worker's row met it.
	TargetP99Ms float64 `json:"target_p99_ms"`
	MetTarget   bool    `json:"met_target"`
}

// String renders the report as a table.
func (r LatencyReport) String() string {
	var sb strings.Builder
	fmt.Fprintf(&sb, "%d jobs per row, one at a time, %s ms apart on average; the clock runs from the commit (or enqueue)\n"+
		"call to the handler's start\n\n", r.Samples, fmtMs(r.PauseMs))
	tw := tabwriter.NewWriter(&sb, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "path\tpoll\tp50 ms\tp90 ms\tp99 ms\tmax ms\tp50 vs asynq\tp99 vs asynq\tput off\t")
	for _, row := range r.Rows {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%.2f\t%.2f\t%d\t\n", row.Name, time.Duration(row.PollMs*float64(time.Millisecond)),
			fmtMs(row.Latency.P50), fmtMs(row.Latency.P90), fmtMs(row.Latency.P99), fmtMs(row.Latency.Max),
			row.P50Ratio, row.P99Ratio, row.LeaseBusy)
	}
	tw.Flush()
	verdict := "met"
	if !r.MetTarget {
		verdict = "NOT met"
	}
	fmt.Fprintf(&sb, "\ntarget p99 ≤ %s ms for the keel worker: %s.\n", fmtMs(r.TargetP99Ms), verdict)
	fmt.Fprintf(&sb, "poll: how long a worker that found its queues empty sleeps before it looks again (asynq sleeps ½–1½\n"+
		"of it); the keel worker (server.New) then waits for announced work (server.Config.IdleWait), the\n"+
		"polling one looks again at once. keel's\n"+
		"way in: the relay, awake while jobs keep coming (here: all along), polls every %s and publishes to\n"+
		"Redis (asleep, EnqueueTx's NOTIFY wakes it); the worker's guard claims the job.\n"+
		"put off: deliveries the guard found locked (the relay had not committed yet) and handed back to asynq.\n",
		outbox.DefaultAwakePoll)
	return sb.String()
}

// The latency part's rows.
const (
	LatencyAsynqDefault = "asynq worker, asynq's default poll"
	LatencyAsynq        = "asynq worker"
	LatencyKeel         = "keel worker (server.New)"
	// LatencyKeelPolling is a keel worker that never waits for announced
	// work (IdleWait < 0) and polls as asynq does.
	LatencyKeelPolling = "keel worker, polling (IdleWait -1)"
)

// asynqDefaultPoll is asynq's TaskCheckInterval when none is set.
const asynqDefaultPoll = time.Second

func (e *env) latency(ctx context.Context) (LatencyReport, error) {
	o := e.o
	rep := LatencyReport{Samples: o.LatencySamples, PauseMs: ms(o.LatencyPause), TargetP99Ms: ms(LatencyTargetP99)}
	client, err := tasks.NewClient(tasks.ClientConfig{Redis: e.redis, Pool: e.pool, Logger: e.warn})
	if err != nil {
		return rep, err
	}
	defer client.Close()
	ac := asynq.NewClient(e.redis)
	defer ac.Close()

	// The producers: plain asynq enqueues; keel commits a transaction that
	// called EnqueueTx. The clock starts just before the call that makes
	// the job visible.
	plainSend := func(ctx context.Context, i int, sent func()) error {
		sent()
		_, err := ac.EnqueueContext(ctx, asynq.NewTask(Kind, []byte(strconv.Itoa(i))), asynq.Queue(Queue))
		return err
	}
	keelSend := func(ctx context.Context, i int, sent func()) error {
		tx, err := e.pool.Begin(ctx)
		if err != nil {
			return err
		}
		defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // no-op after commit
		t := tasks.NewRaw(Kind, []byte(strconv.Itoa(i)), fmt.Sprintf("lat-%d", i), tasks.Queue(Queue))
		if _, err := client.EnqueueTx(ctx, tx, t); err != nil {
			return err
		}
		sent()
		return tx.Commit(ctx)
	}
	rows := []struct {
		name, from string
		poll       time.Duration
		send       func(context.Context, int, func()) error
		start      func(h asynq.Handler, poll time.Duration) (stop func() error, busy func() uint64, err error)
	}{
		{LatencyAsynqDefault, "Client.Enqueue", asynqDefaultPoll, plainSend, e.startAsynq},
		{LatencyAsynq, "Client.Enqueue", o.Poll, plainSend, e.startAsynq},
		{LatencyKeel, "EnqueueTx commit", server.DefaultTaskCheckInterval, keelSend, e.startKeelWorker},
		{LatencyKeelPolling, "EnqueueTx commit", o.Poll, keelSend, e.startKeelPolling},
	}
	var base Latency
	for _, row := range rows {
		if err := e.reset(ctx); err != nil {
			return rep, err
		}
		st := newStamps(o.LatencySamples)
		stop, busy, err := row.start(st, row.poll)
		if err != nil {
			return rep, fmt.Errorf("%s: %w", row.name, err)
		}
		// Let the worker settle: asynq's first look finds the queues empty,
		// and keel's relay starts listening for commits.
		time.Sleep(250 * time.Millisecond)
		finish := e.step(row.name, o.LatencySamples, st.count)
		err = st.produce(ctx, o.LatencySamples, o.LatencyPause, row.send)
		if err == nil {
			// A job the guard put off comes back through asynq's retry set:
			// give those time to arrive.
			err = st.wait(ctx, 30*time.Second+2*row.poll)
		}
		finish()
		if serr := stop(); err == nil {
			err = serr
		}
		lr := LatencyRow{Name: row.name, From: row.from, PollMs: ms(row.poll), Samples: st.count(), Latency: summarize(st.latencies()),
			LeaseBusy: busy()}
		if row.name == LatencyAsynq {
			base = lr.Latency
		}
		rep.Rows = append(rep.Rows, lr)
		if err != nil {
			return rep, fmt.Errorf("%s: %w", row.name, err)
		}
		if row.name == LatencyKeel {
			rep.MetTarget = lr.Latency.P99 <= rep.TargetP99Ms
		}
	}
	for i := range rep.Rows {
		l := &rep.Rows[i]
		l.P50Ratio, l.P99Ratio = ratio(l.Latency.P50, base.P50), ratio(l.Latency.P99, base.P99)
	}
	return rep, nil
}

// startAsynq starts a plain asynq worker running h that polls every poll.
func (e *env) startAsynq(h asynq.Handler, poll time.Duration) (func() error, func() uint64, error) {
	srv := asynq.NewServer(e.redis, asynq.Config{Concurrency: e.o.Concurrency, Queues: Queues(), TaskCheckInterval: poll,
		Logger: quietAsynq{e.warn}, LogLevel: asynq.WarnLevel})
	if err := srv.Start(h); err != nil {
		return nil, nil, err
	}
	return func() error { srv.Shutdown(); return nil }, func() uint64 { return 0 }, nil
}

// startKeelWorker starts a keel worker (server.New, with its relay) running
// h that polls every poll and, idle, waits for announced work.
func (e *env) startKeelWorker(h asynq.Handler, poll time.Duration) (func() error, func() uint64, error) {
	return e.keelWorker(h, poll, 0)
}

// startKeelPolling starts a keel worker that polls every poll and never
// waits for announced work.
func (e *env) startKeelPolling(h asynq.Handler, poll time.Duration) (func() error, func() uint64, error) {
	return e.keelWorker(h, poll, -1)
}

func (e *env) keelWorker(h asynq.Handler, poll, idleWait time.Duration) (func() error, func() uint64, error) {
	srv, err := server.New(server.Config{Redis: e.redis, Pool: e.pool, Queues: Queues(), Concurrency: e.o.Concurrency,
		TaskCheckInterval: poll, IdleWait: idleWait, Logger: e.warn}, h)
	if err != nil {
		return nil, nil, err
	}
	w := startServer(srv)
	return w.stop, func() uint64 { return srv.GuardStats().LeaseBusy }, nil
}

// stamps records when each sample was sent and when its handler started,
// as offsets from a common base on the monotonic clock.
type stamps struct {
	base    time.Time
	sent    []atomic.Int64
	started []atomic.Int64
	n       atomic.Int64
	all     chan struct{}
}

func newStamps(n int) *stamps {
	return &stamps{base: time.Now(), sent: make([]atomic.Int64, n), started: make([]atomic.Int64, n), all: make(chan struct{})}
}

func (s *stamps) now() int64 { return int64(time.Since(s.base)) + 1 } // never 0: 0 means not yet

// ProcessTask records the handler's start of the sample in the payload.
func (s *stamps) ProcessTask(_ context.Context, t *asynq.Task) error {
	at := s.now()
	i, err := strconv.Atoi(string(t.Payload()))
	if err != nil || i < 0 || i >= len(s.started) {
		return fmt.Errorf("%w: payload %q is no sample", asynq.SkipRetry, t.Payload())
	}
	if s.started[i].CompareAndSwap(0, at) && s.n.Add(1) == int64(len(s.started)) {
		close(s.all)
	}
	return nil
}

func (s *stamps) count() int { return int(s.n.Load()) }

// produce sends n samples one at a time, pausing between them.
func (s *stamps) produce(ctx context.Context, n int, pause time.Duration, send func(context.Context, int, func()) error) error {
	for i := range n {
		// Random pauses keep the sends from falling into step with the
		// worker's polling.
		d := pause/2 + rand.N(pause+1)
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(d):
		}
		if err := send(ctx, i, func() { s.sent[i].Store(s.now()) }); err != nil {
			return err
		}
	}
	return nil
}

// wait returns when every sample has reached its handler.
func (s *stamps) wait(ctx context.Context, timeout time.Duration) error {
	select {
	case <-s.all:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(timeout):
		return fmt.Errorf("%d of %d samples reached the handler within %s", s.count(), len(s.started), timeout)
	}
}

// latencies are the send-to-start durations of the samples that started.
func (s *stamps) latencies() []time.Duration {
	var ds []time.Duration
	for i := range s.started {
		st, se := s.started[i].Load(), s.sent[i].Load()
		if st != 0 && se != 0 {
			ds = append(ds, time.Duration(st-se))
		}
	}
	return ds
}
