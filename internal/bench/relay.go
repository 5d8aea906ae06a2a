package bench

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"text/tabwriter"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"

	"github.com/keeljobs/keel/internal/jobstore"
	"github.com/keeljobs/keel/internal/ledger"
	"github.com/keeljobs/keel/outbox"
	"github.com/keeljobs/keel/tasks"
)

// RelayTxJobs is how many EnqueueTx calls share one transaction when the
// relay part fills the ledger.
const RelayTxJobs = 1000

// RelayRow is one way of getting the committed jobs into Redis, timed.
type RelayRow struct {
	Name    string  `json:"name"`
	Relays  int     `json:"relays,omitempty"`
	Jobs    int     `json:"jobs"`
	Seconds float64 `json:"seconds"`
	// JobsPerSecond is how many jobs reached Redis per second.
	JobsPerSecond float64 `json:"jobs_per_second"`
	// Ratio is the rate over that of asynq's client, one producer.
	Ratio float64 `json:"ratio_to_asynq"`
	// RoundRatios is every round's ratio when there were several; the
	// row's figures are those of the median round.
	RoundRatios []float64 `json:"round_ratios,omitempty"`
}

// RelayReport is the relay part's result.
type RelayReport struct {
	Jobs int `json:"jobs"`
	// TxJobs is how many jobs each EnqueueTx transaction held, and
	// EnqueueTxJobsPerSecond how fast they went in (the mean over every
	// fill of the ledger).
	TxJobs                 int     `json:"tx_jobs"`
	EnqueueTxJobsPerSecond float64 `json:"enqueue_tx_jobs_per_second"`
	// BatchSize is how many rows one relay pass claims.
	BatchSize int        `json:"batch_size"`
	Rounds    int        `json:"rounds"`
	Rows      []RelayRow `json:"rows"`
	// Commits are EnqueueTx's commit rate with Producers at once, a relay
	// running or not, against the bare ledger INSERT with a relay running.
	Producers int         `json:"producers"`
	Commits   []CommitRow `json:"commits"`
}

// CommitRow is one way of committing jobs, 1 per transaction, timed.
type CommitRow struct {
	Name          string  `json:"name"`
	Jobs          int     `json:"jobs"`
	Seconds       float64 `json:"seconds"`
	JobsPerSecond float64 `json:"jobs_per_second"`
	Call          Latency `json:"per_call"`
	// Ratio is the rate over the bare ledger INSERT's.
	Ratio float64 `json:"ratio_to_insert"`
	// RoundRatios: as RelayRow's.
	RoundRatios []float64 `json:"round_ratios,omitempty"`
}

// The commit rows of the relay part.
const (
	CommitInsert    = "ledger INSERT, relay running"
	CommitTxAwake   = "keel EnqueueTx, relay running"
	CommitTxNoRelay = "keel EnqueueTx, no relay (every commit notifies)"
)

// String renders the report as a table.
func (r RelayReport) String() string {
	var sb strings.Builder
	fmt.Fprintf(&sb, "%d jobs committed with EnqueueTx, %d per transaction (%.0f jobs/s), no relay running; then the relays publish them\n\n",
		r.Jobs, r.TxJobs, r.EnqueueTxJobsPerSecond)
	if r.Rounds > 1 {
		fmt.Fprintf(&sb, "%d rounds; each row shows its median round, \"rounds\" every round's ratio\n\n", r.Rounds)
	}
	tw := tabwriter.NewWriter(&sb, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "publisher\tjobs\tseconds\tjobs/s\tvs asynq\t"+roundsHeader(r.Rounds))
	for _, row := range r.Rows {
		fmt.Fprintf(tw, "%s\t%d\t%.2f\t%.0f\t%.2f\t%s\n", row.Name, row.Jobs, row.Seconds, row.JobsPerSecond, row.Ratio,
			fmtRounds(row.RoundRatios))
	}
	tw.Flush()
	fmt.Fprintf(&sb, "\nA relay pass takes up to %d rows off the outbox (FOR UPDATE SKIP LOCKED, DELETE, commit), reads their jobs,\n"+
		"then puts them into Redis with one script call per queue (the writes asynq's client makes, %d calls in flight);\n"+
		"asynq Client.Enqueue, one producer, is the same Redis work one task at a time.\n", r.BatchSize, jobstore.PublishInFlight)
	if len(r.Commits) > 0 {
		fmt.Fprintf(&sb, "\n%d producers, 1 job per transaction:\n\n", r.Producers)
		tw = tabwriter.NewWriter(&sb, 0, 0, 2, ' ', tabwriter.AlignRight)
		fmt.Fprintln(tw, "commits\tjobs\tseconds\tjobs/s\tp50 ms\tp99 ms\tvs INSERT\t"+roundsHeader(r.Rounds))
		for _, row := range r.Commits {
			fmt.Fprintf(tw, "%s\t%d\t%.2f\t%.0f\t%s\t%s\t%.2f\t%s\n", row.Name, row.Jobs, row.Seconds, row.JobsPerSecond,
				fmtMs(row.Call.P50), fmtMs(row.Call.P99), row.Ratio, fmtRounds(row.RoundRatios))
		}
		tw.Flush()
		fmt.Fprintf(&sb, "\nWhile a relay is awake (rows keep coming) EnqueueTx's writers do not NOTIFY, whose commit-time\n"+
			"lock would make their commits wait for each other; the awake relay polls every %s instead.\n"+
			"With no relay running every commit notifies. The INSERT row's relay polls as often, and publishes its jobs too.\n", outbox.DefaultAwakePoll)
	}
	return sb.String()
}

func (e *env) relay(ctx context.Context) (RelayReport, error) {
	var rows [][]RelayRow
	var commits [][]CommitRow
	var rep RelayReport
	merge := func() {
		rep.Rounds = e.o.Rounds
		rep.Rows = medianRows(rows, func(r RelayRow) float64 { return r.Ratio }, func(r *RelayRow, rs []float64) { r.RoundRatios = rs })
		rep.Commits = medianRows(commits, func(r CommitRow) float64 { return r.Ratio }, func(r *CommitRow, rs []float64) { r.RoundRatios = rs })
	}
	defer func() { e.roundLabel = "" }()
	for i := range e.o.Rounds {
		e.roundLabel = roundSuffix(i, e.o.Rounds)
		rd, err := e.relayRound(ctx)
		rep = rd
		rows, commits = append(rows, rd.Rows), append(commits, rd.Commits)
		if err != nil {
			merge()
			return rep, err
		}
	}
	merge()
	return rep, nil
}

func (e *env) relayRound(ctx context.Context) (RelayReport, error) {
	o := e.o
	n := o.RelayJobs
	rep := RelayReport{Jobs: n, TxJobs: RelayTxJobs, BatchSize: outbox.DefaultBatchSize}
	ctx, cancel := context.WithTimeout(ctx, o.timeout(4*n))
	defer cancel()

	// The baseline: the same jobs through asynq's client, one at a time.
	base := RelayRow{Name: "asynq Client.Enqueue, 1 producer", Jobs: n}
	ac := asynq.NewClient(e.redis)
	var sent atomic.Int64
	finish := e.step(base.Name, n, func() int { return int(sent.Load()) })
	start := time.Now()
	var err error
	for i := 0; i < n && err == nil; i++ {
		_, err = ac.EnqueueContext(ctx, asynq.NewTask(Kind, payload), asynq.Queue(Queue))
		sent.Add(1)
	}
	base.Seconds = time.Since(start).Seconds()
	finish()
	ac.Close()
	if err != nil {
		return rep, err
	}
	base.JobsPerSecond, base.Ratio = float64(n)/base.Seconds, 1
	rep.Rows = append(rep.Rows, base)

	var fillRate float64
	for k, relays := range []int{1, 2} {
		if err := e.reset(ctx); err != nil {
			return rep, err
		}
		rate, err := e.fillUnpublished(ctx, n)
		if err != nil {
			return rep, err
		}
		fillRate += rate
		rep.EnqueueTxJobsPerSecond = fillRate / float64(k+1)
		row, err := e.runRelays(ctx, relays, n)
		row.Ratio = ratio(row.JobsPerSecond, base.JobsPerSecond)
		rep.Rows = append(rep.Rows, row)
		if err != nil {
			return rep, err
		}
	}
	if err := e.commits(ctx, &rep); err != nil {
		return rep, err
	}
	return rep, e.reset(ctx)
}

// commits measures EnqueueTx's commits against the bare ledger INSERT,
// Producers at once, with and without a relay running.
func (e *env) commits(ctx context.Context, rep *RelayReport) error {
	o := e.o
	rep.Producers = o.Producers
	client, err := tasks.NewClient(tasks.ClientConfig{Redis: e.redis, Pool: e.pool, Logger: e.warn})
	if err != nil {
		return err
	}
	defer client.Close()
	enqueueTx := func(ctx context.Context, key string) error {
		return pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error {
			_, err := client.EnqueueTx(ctx, tx, tasks.NewRaw(Kind, payload, key, tasks.Queue(Queue)))
			return err
		})
	}
	insert := func(ctx context.Context, key string) error {
		return pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error {
			_, _, err := jobstore.NewStore(client.Pool()).Insert(ctx, tx, jobstore.NewJob{Kind: Kind, BusinessKey: key, Queue: Queue,
				Payload: payload, MaxRetry: tasks.DefaultMaxRetry})
			return err
		})
	}
	var base float64
	for _, m := range []struct {
		name  string
		relay bool
		call  func(context.Context, string) error
	}{
		{CommitInsert, true, insert},
		{CommitTxAwake, true, enqueueTx},
		{CommitTxNoRelay, false, enqueueTx},
	} {
		if err := e.reset(ctx); err != nil {
			return err
		}
		stop := func() {}
		if m.relay {
			// Polling as often as an awake relay, the INSERT row's relay
			// publishes its rows as they come too: the same work downstream.
			cfg := outbox.RelayConfig{Pool: e.pool, Redis: e.redis, Logger: e.warn}
			if m.name == CommitInsert {
				cfg.PollInterval = outbox.DefaultAwakePoll
			}
			r, err := outbox.NewRelay(cfg)
			if err != nil {
				return err
			}
			rctx, cancel := context.WithCancel(ctx)
			done := make(chan struct{})
			go func() { defer close(done); _ = r.Run(rctx) }()
			stop = func() { cancel(); <-done; r.Close() }
		}
		er, err := e.measureEnqueue(ctx, enqueueMethod{name: m.name, call: m.call}, o.Producers, o.EnqueueJobs)
		stop()
		row := CommitRow{Name: m.name, Jobs: er.Jobs, Seconds: er.Seconds, JobsPerSecond: er.JobsPerSecond, Call: er.Call}
		if m.name == CommitInsert {
			base = row.JobsPerSecond
		}
		row.Ratio = ratio(row.JobsPerSecond, base)
		rep.Commits = append(rep.Commits, row)
		if err != nil {
			return fmt.Errorf("%s: %w", m.name, err)
		}
	}
	return nil
}

// fillUnpublished commits n jobs with EnqueueTx, RelayTxJobs per
// transaction, while no relay runs, and returns how many went in per second.
func (e *env) fillUnpublished(ctx context.Context, n int) (float64, error) {
	client, err := tasks.NewClient(tasks.ClientConfig{Redis: e.redis, Pool: e.pool, Logger: e.warn})
	if err != nil {
		return 0, err
	}
	defer client.Close()
	var committed atomic.Int64
	finish := e.step(fmt.Sprintf("EnqueueTx, %d jobs per transaction", RelayTxJobs), n, func() int { return int(committed.Load()) })
	defer finish()
	start := time.Now()
	for done := 0; done < n; done = min(done+RelayTxJobs, n) {
		err := pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error {
			for j := done; j < min(done+RelayTxJobs, n); j++ {
				t := tasks.NewRaw(Kind, payload, fmt.Sprintf("relay-%d", j), tasks.Queue(Queue))
				if _, err := client.EnqueueTx(ctx, tx, t); err != nil {
					return err
				}
			}
			return nil
		})
		if err != nil {
			return 0, err
		}
		committed.Store(int64(min(done+RelayTxJobs, n)))
	}
	rate := float64(n) / time.Since(start).Seconds()
	if err := ledger.AnalyzeJobs(ctx, e.pool); err != nil {
		return rate, err
	}
	return rate, nil
}

// runRelays runs k relays until they have published n jobs, and checks that
// the ledger and Redis agree they did.
func (e *env) runRelays(ctx context.Context, k, n int) (RelayRow, error) {
	row := RelayRow{Name: fmt.Sprintf("%d outbox.Relay", k), Relays: k, Jobs: n}
	if k > 1 {
		row.Name += "s"
	}
	rctx, stop := context.WithCancel(ctx)
	var wg sync.WaitGroup
	relays := make([]*outbox.Relay, k)
	for i := range relays {
		r, err := outbox.NewRelay(outbox.RelayConfig{Pool: e.pool, Redis: e.redis, Logger: e.warn})
		if err != nil {
			stop()
			for _, r := range relays[:i] {
				r.Close()
			}
			return row, err
		}
		relays[i] = r
	}
	published := func() int {
		sum := 0
		for _, r := range relays {
			sum += int(r.Published())
		}
		return sum
	}
	finish := e.step(row.Name, n, published)
	start := time.Now()
	for _, r := range relays {
		wg.Go(func() { _ = r.Run(rctx) })
	}
	var err error
	for published() < n && err == nil {
		select {
		case <-ctx.Done():
			err = fmt.Errorf("%d of %d jobs published: %w", published(), n, ctx.Err())
		case <-time.After(2 * time.Millisecond):
		}
	}
	row.Seconds = time.Since(start).Seconds()
	finish()
	stop()
	wg.Wait()
	for _, r := range relays {
		err = errors.Join(err, r.Close())
	}
	row.JobsPerSecond = float64(published()) / row.Seconds
	if err != nil {
		return row, err
	}
	unpublished, err := ledger.Unpublished(ctx, e.pool)
	if err != nil {
		return row, err
	}
	insp := asynq.NewInspector(e.redis)
	defer insp.Close()
	info, err := insp.GetQueueInfo(Queue)
	if err != nil {
		return row, err
	}
	if unpublished != 0 || info.Pending != n || published() != n {
		return row, fmt.Errorf("relays published %d, ledger has %d unpublished, queue holds %d, want %d", published(), unpublished, info.Pending, n)
	}
	return row, nil
}
