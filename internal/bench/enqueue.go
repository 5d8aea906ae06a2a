package bench

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"text/tabwriter"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"

	"github.com/keeljobs/keel/internal/jobstore"
	"github.com/keeljobs/keel/outbox"
	"github.com/keeljobs/keel/tasks"
)

// The enqueue part's methods.
const (
	MethodAsynq     = "asynq Client.Enqueue"
	MethodEnqueue   = "keel Enqueue"
	MethodEnqueueTx = "keel EnqueueTx, 1 job/tx"
	MethodInsert    = "ledger INSERT, 1 row/tx"
	// The bulk rows, one producer, BulkPerCall jobs per call; their ratio
	// is to one producer's asynq Client.Enqueue.
	MethodEnqueueMany   = "keel EnqueueMany, 1,000/call"
	MethodEnqueueManyTx = "keel EnqueueManyTx, 1,000/tx, until in Redis"
)

// BulkPerCall is how many jobs one EnqueueMany or EnqueueManyTx call of the
// bulk rows takes; the bulk rows enqueue BulkRowFactor times a row's jobs.
const (
	BulkPerCall   = 1000
	BulkRowFactor = 10
)

// EnqueueRow is one enqueue method measured with some producers.
type EnqueueRow struct {
	Method    string `json:"method"`
	Producers int    `json:"producers"`
	Jobs      int    `json:"jobs"`
	// Seconds from the first call until the last returned.
	Seconds       float64 `json:"seconds"`
	JobsPerSecond float64 `json:"jobs_per_second"`
	// Call is the duration of one call (for EnqueueTx: begin, enqueue and
	// commit).
	Call Latency `json:"per_call"`
	// Ratio is the rate over plain Asynq's with as many producers.
	Ratio float64 `json:"ratio_to_asynq"`
	// RoundRatios is every round's ratio when there were several; the
	// row's figures are those of the median round.
	RoundRatios []float64 `json:"round_ratios,omitempty"`
	// What one job cost: this process's CPU (producers, and the relay of
	// the EnqueueManyTx row), Redis's and Postgres's CPU in ms, and the
	// write-ahead log Postgres wrote, in bytes.
	ClientCPUms   float64 `json:"client_cpu_ms_per_job"`
	RedisCPUms    float64 `json:"redis_cpu_ms_per_job,omitempty"`
	PostgresCPUms float64 `json:"postgres_cpu_ms_per_job,omitempty"`
	WALBytes      float64 `json:"postgres_wal_bytes_per_job,omitempty"`
}

// cost fills row's cost columns from a meter started with the row.
func (row *EnqueueRow) cost(m *meter) {
	ph := Phase{Jobs: row.Jobs}
	m.stop(&ph)
	row.ClientCPUms, row.RedisCPUms, row.PostgresCPUms, row.WALBytes = ph.WorkerCPUms, ph.RedisCPUms, ph.PostgresCPUms, ph.PostgresWALBytes
}

// EnqueueReport is the enqueue part's result: each method with one
// producer, then with Producers at once, then the bulk methods.
type EnqueueReport struct {
	Jobs      int          `json:"jobs"`
	Producers int          `json:"producers"`
	Rounds    int          `json:"rounds"`
	Rows      []EnqueueRow `json:"rows"`
}

// String renders the report as a table.
func (r EnqueueReport) String() string {
	var sb strings.Builder
	fmt.Fprintf(&sb, "%d jobs per row (bulk rows: %d), one producer and then %d at once; the ledger and the queue are emptied between rows\n",
		r.Jobs, BulkRowFactor*r.Jobs, r.Producers)
	if r.Rounds > 1 {
		fmt.Fprintf(&sb, "%d rounds; each row shows its median round, \"rounds\" every round's ratio\n", r.Rounds)
	}
	sb.WriteString("\n")
	tw := tabwriter.NewWriter(&sb, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "method\tproducers\tjobs/s\tp50 ms\tp99 ms\tvs asynq\tclient µs/job\tredis µs/job\tpostgres µs/job\tWAL B/job\t"+roundsHeader(r.Rounds))
	us := func(ms float64) string { return fmt.Sprintf("%.1f", ms*1000) }
	wal := func(b float64) string {
		if b == 0 {
			return "-"
		}
		return fmt.Sprintf("%.0f", b)
	}
	for _, row := range r.Rows {
		fmt.Fprintf(tw, "%s\t%d\t%.0f\t%s\t%s\t%.2f\t%s\t%s\t%s\t%s\t%s\n", row.Method, row.Producers, row.JobsPerSecond,
			fmtMs(row.Call.P50), fmtMs(row.Call.P99), row.Ratio, us(row.ClientCPUms), us(row.RedisCPUms), us(row.PostgresCPUms),
			wal(row.WALBytes), fmtRounds(row.RoundRatios))
	}
	tw.Flush()
	fmt.Fprintf(&sb, "\nkeel Enqueue: ledger INSERT written claimed, commit and publish (concurrent calls share both: group commit).\n"+
		"keel EnqueueMany: one INSERT … SELECT FROM unnest per 1,000 jobs (commit), then one Redis script per 200 jobs (the same writes as asynq's client); p50/p99 per call.\n"+
		"keel EnqueueManyTx: BEGIN, the same INSERT with pg_notify, COMMIT; timed until one relay has put every job in Redis.\n"+
		"keel EnqueueTx: BEGIN, INSERT with pg_notify in the same statement, COMMIT; the relay publishes later.\n"+
		"ledger INSERT: the same INSERT in its own transaction without pg_notify (Postgres' floor for EnqueueTx).\n")
	return sb.String()
}

// enqueueMethod enqueues job i (with a business key unique in the run).
type enqueueMethod struct {
	name string
	call func(ctx context.Context, key string) error
}

func (e *env) enqueueRates(ctx context.Context) (EnqueueReport, error) {
	rep := EnqueueReport{Jobs: e.o.EnqueueJobs, Producers: e.o.Producers, Rounds: e.o.Rounds}
	var rounds [][]EnqueueRow
	for i := range e.o.Rounds {
		e.roundLabel = roundSuffix(i, e.o.Rounds)
		rd, err := e.enqueueRound(ctx)
		rounds = append(rounds, rd.Rows)
		if err != nil {
			rep.Rows = medianRows(rounds, func(r EnqueueRow) float64 { return r.Ratio }, func(r *EnqueueRow, rs []float64) { r.RoundRatios = rs })
			return rep, err
		}
	}
	e.roundLabel = ""
	rep.Rows = medianRows(rounds, func(r EnqueueRow) float64 { return r.Ratio }, func(r *EnqueueRow, rs []float64) { r.RoundRatios = rs })
	return rep, nil
}

func (e *env) enqueueRound(ctx context.Context) (EnqueueReport, error) {
	o := e.o
	rep := EnqueueReport{Jobs: o.EnqueueJobs, Producers: o.Producers}
	client, err := tasks.NewClient(tasks.ClientConfig{Redis: e.redis, Pool: e.pool, Logger: e.warn})
	if err != nil {
		return rep, err
	}
	defer client.Close()
	ac := asynq.NewClient(e.redis)
	defer ac.Close()
	methods := []enqueueMethod{
		{MethodAsynq, func(ctx context.Context, _ string) error {
			_, err := ac.EnqueueContext(ctx, asynq.NewTask(Kind, payload), asynq.Queue(Queue))
			return err
		}},
		{MethodEnqueue, func(ctx context.Context, key string) error {
			res, err := client.Enqueue(ctx, tasks.NewRaw(Kind, payload, key, tasks.Queue(Queue)))
			if err == nil && !res.Published {
				err = fmt.Errorf("job %s was not published", res.Job.ID)
			}
			return err
		}},
		{MethodEnqueueTx, func(ctx context.Context, key string) error {
			return pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error {
				_, err := client.EnqueueTx(ctx, tx, tasks.NewRaw(Kind, payload, key, tasks.Queue(Queue)))
				return err
			})
		}},
		{MethodInsert, func(ctx context.Context, key string) error {
			return pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error {
				_, _, err := jobstore.NewStore(client.Pool()).Insert(ctx, tx, jobstore.NewJob{Kind: Kind, BusinessKey: key, Queue: Queue,
					Payload: payload, MaxRetry: tasks.DefaultMaxRetry})
				return err
			})
		}},
	}
	ctx, cancel := context.WithTimeout(ctx, o.timeout((8+2*BulkRowFactor)*o.EnqueueJobs))
	defer cancel()
	for _, producers := range []int{1, o.Producers} {
		var asynqRate float64
		for _, m := range methods {
			if err := e.reset(ctx); err != nil {
				return rep, err
			}
			row, err := e.measureEnqueue(ctx, m, producers, o.EnqueueJobs)
			if m.name == MethodAsynq {
				asynqRate = row.JobsPerSecond
			}
			row.Ratio = ratio(row.JobsPerSecond, asynqRate)
			rep.Rows = append(rep.Rows, row)
			if err != nil {
				return rep, fmt.Errorf("%s, %d producers: %w", m.name, producers, err)
			}
		}
	}
	if err := e.reset(ctx); err != nil {
		return rep, err
	}
	asynqRate := rep.Rows[0].JobsPerSecond
	for _, m := range []string{MethodEnqueueMany, MethodEnqueueManyTx} {
		row, err := e.measureBulk(ctx, client, m, BulkRowFactor*o.EnqueueJobs)
		row.Ratio = ratio(row.JobsPerSecond, asynqRate)
		rep.Rows = append(rep.Rows, row)
		if err != nil {
			return rep, fmt.Errorf("%s: %w", m, err)
		}
		if err := e.reset(ctx); err != nil {
			return rep, err
		}
	}
	return rep, nil
}

// measureBulk enqueues n jobs BulkPerCall at a time with one producer. For
// EnqueueManyTx the clock stops when a relay has published every job.
func (e *env) measureBulk(ctx context.Context, client *tasks.Client, method string, n int) (EnqueueRow, error) {
	row := EnqueueRow{Method: method, Producers: 1, Jobs: n}
	var relay *outbox.Relay
	stopRelay := func() {}
	if method == MethodEnqueueManyTx {
		var err error
		if relay, err = outbox.NewRelay(outbox.RelayConfig{Pool: e.pool, Redis: e.redis, Logger: e.warn}); err != nil {
			return row, err
		}
		rctx, cancel := context.WithCancel(ctx)
		done := make(chan struct{})
		go func() { defer close(done); _ = relay.Run(rctx) }()
		stopRelay = func() { cancel(); <-done; relay.Close() }
	}
	defer stopRelay()
	var done atomic.Int64
	finish := e.step(fmt.Sprintf("%s ×1", method), n, func() int { return int(done.Load()) })
	var ds []time.Duration
	m := startMeter(e.pool)
	start := time.Now()
	for i := 0; i < n; i += BulkPerCall {
		ts := make([]*tasks.Task, 0, BulkPerCall)
		for j := i; j < min(n, i+BulkPerCall); j++ {
			ts = append(ts, tasks.NewRaw(Kind, payload, fmt.Sprintf("bulk-%d", j), tasks.Queue(Queue)))
		}
		t0 := time.Now()
		var err error
		if method == MethodEnqueueMany {
			var res []*tasks.Result
			if res, err = client.EnqueueMany(ctx, ts...); err == nil {
				for _, r := range res {
					if !r.Published {
						err = fmt.Errorf("job %s was not published", r.Job.ID)
						break
					}
				}
			}
		} else {
			err = pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error {
				_, err := client.EnqueueManyTx(ctx, tx, ts...)
				return err
			})
		}
		if err != nil {
			finish()
			return row, err
		}
		ds = append(ds, time.Since(t0))
		done.Add(int64(len(ts)))
	}
	if relay != nil {
		for relay.Published() < uint64(n) {
			if ctx.Err() != nil {
				finish()
				return row, fmt.Errorf("%d of %d jobs published: %w", relay.Published(), n, ctx.Err())
			}
			time.Sleep(time.Millisecond)
		}
	}
	row.Seconds = time.Since(start).Seconds()
	row.cost(m)
	finish()
	row.Call = summarize(ds)
	row.JobsPerSecond = float64(n) / row.Seconds
	return row, nil
}

// measureEnqueue makes n calls of m from producers goroutines and times each.
func (e *env) measureEnqueue(ctx context.Context, m enqueueMethod, producers, n int) (EnqueueRow, error) {
	row := EnqueueRow{Method: m.name, Producers: producers, Jobs: n}
	var next, done atomic.Int64
	durations := make([][]time.Duration, producers)
	errs := make([]error, producers)
	finish := e.step(fmt.Sprintf("%s ×%d", m.name, producers), n, func() int { return int(done.Load()) })
	var wg sync.WaitGroup
	db := e.pool
	if m.name == MethodAsynq {
		db = nil // it writes no ledger rows: WAL now is someone else's
	}
	meter := startMeter(db)
	start := time.Now()
	for p := range producers {
		wg.Go(func() {
			ds := make([]time.Duration, 0, n/producers+1)
			for {
				i := int(next.Add(1)) - 1
				if i >= n || ctx.Err() != nil {
					break
				}
				t0 := time.Now()
				if err := m.call(ctx, fmt.Sprintf("enq-%d-%d", producers, i)); err != nil {
					errs[p] = err
					break
				}
				ds = append(ds, time.Since(t0))
				done.Add(1)
			}
			durations[p] = ds
		})
	}
	wg.Wait()
	row.Seconds = time.Since(start).Seconds()
	row.cost(meter)
	finish()
	var all []time.Duration
	for _, ds := range durations {
		all = append(all, ds...)
	}
	row.Call = summarize(all)
	row.JobsPerSecond = float64(len(all)) / row.Seconds
	for _, err := range errs {
		if err != nil {
			return row, err
		}
	}
	if len(all) != n {
		return row, fmt.Errorf("%d of %d calls made: %w", len(all), n, ctx.Err())
	}
	return row, nil
}
