package main

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"

	"github.com/keeljobs/keel/internal/bench"
	"github.com/keeljobs/keel/migrate"
	"github.com/keeljobs/keel/outbox"
	"github.com/keeljobs/keel/tasks"
)

// The enqueue comparison's methods: one producer, enqueueBatch jobs per
// transaction, BEGIN … COMMIT.
const (
	MethodKeel             = "EnqueueManyTx, until in Redis"
	MethodRiverInsert      = "InsertManyTx"
	MethodRiverInsertFast  = "InsertManyFastTx (COPY)"
	MethodRiverInsertUniq  = "InsertManyTx, UniqueOpts{ByArgs}"
	enqueueBatch           = 1000
	enqueueKeyFormat       = "e%08d"
	enqueuePhaseTimeoutMin = time.Minute
)

// riverMethods are River's rows, in the order each round runs them.
var riverMethods = []string{MethodRiverInsert, MethodRiverInsertFast, MethodRiverInsertUniq}

// EnqueuePhase is one system enqueueing the jobs once.
type EnqueuePhase struct {
	System        string  `json:"system"`
	Method        string  `json:"method"`
	Jobs          int     `json:"jobs"`
	Seconds       float64 `json:"seconds"`
	JobsPerSecond float64 `json:"jobs_per_second"`
	// CPU per job, in milliseconds, while the clock ran: this process,
	// Postgres and Redis (all their processes on this host).
	WorkerCPUms   float64 `json:"worker_cpu_ms_per_job"`
	PostgresCPUms float64 `json:"postgres_cpu_ms_per_job"`
	RedisCPUms    float64 `json:"redis_cpu_ms_per_job"`
	// OtherCores is how many cores other processes kept busy meanwhile (-1:
	// unknown here).
	OtherCores float64 `json:"other_cores_busy"`
	// Stored is how many jobs were found afterwards: for River, available
	// rows in river_job (with a unique key for the unique row); for keel,
	// tasks pending in its Redis queue.
	Stored int `json:"stored"`
}

// EnqueueRound is keel, then each River method, one after the other.
type EnqueueRound struct {
	Keel  EnqueuePhase   `json:"keel"`
	River []EnqueuePhase `json:"river"`
	// Ratios is keel's rate over each River row's, in River's order.
	Ratios []float64 `json:"ratios"`
}

// EnqueueRatio is keel over one River method, the median of the rounds.
type EnqueueRatio struct {
	River  string    `json:"river"`
	Rounds []float64 `json:"rounds"`
	Median float64   `json:"median"`
}

// EnqueueReport is the enqueue comparison's result.
type EnqueueReport struct {
	Jobs   int            `json:"jobs"`
	PerTx  int            `json:"jobs_per_tx"`
	Rounds []EnqueueRound `json:"rounds"`
	Ratios []EnqueueRatio `json:"ratios"`
}

func (r EnqueueReport) String() string {
	var sb strings.Builder
	fmt.Fprintf(&sb, "bulk enqueue: %d jobs per system per round, %d per transaction (BEGIN, insert, COMMIT), one producer; the stores are emptied between phases\n\n",
		r.Jobs, r.PerTx)
	tw := tabwriter.NewWriter(&sb, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "round\tsystem\tmethod\tjobs\tseconds\tjobs/s\tworker cpu ms/job\tpostgres cpu ms/job\tredis cpu ms/job\tother cores busy\tstored\t")
	for i, rd := range r.Rounds {
		for _, p := range append([]EnqueuePhase{rd.Keel}, rd.River...) {
			other := "?"
			if p.OtherCores >= 0 {
				other = fmt.Sprintf("%.2f", p.OtherCores)
			}
			fmt.Fprintf(tw, "%d\t%s\t%s\t%d\t%.2f\t%.0f\t%.3f\t%.3f\t%.3f\t%s\t%d\t\n", i+1, p.System, p.Method, p.Jobs, p.Seconds,
				p.JobsPerSecond, p.WorkerCPUms, p.PostgresCPUms, p.RedisCPUms, other, p.Stored)
		}
	}
	tw.Flush()
	sb.WriteString("\n")
	for _, ra := range r.Ratios {
		fmt.Fprintf(&sb, "ratio keel/River %s: per round", ra.River)
		for _, x := range ra.Rounds {
			fmt.Fprintf(&sb, " %.2f", x)
		}
		fmt.Fprintf(&sb, "; median %.2f\n", ra.Median)
	}
	sb.WriteString("\nkeel: tasks.Client.EnqueueManyTx, timed until one outbox.Relay (started before the clock) has put every job in Redis.\n" +
		"River: a job is workable once committed, so its clock stops at the last COMMIT.\n" +
		"keel dedupes every job by (kind, business key); River's InsertManyTx and InsertManyFastTx rows insert without\n" +
		"uniqueness, its UniqueOpts{ByArgs} row dedupes by the job's args (here: the key).\n")
	return sb.String()
}

// enqueueRates alternates keel and River's methods for s.rounds rounds.
func enqueueRates(ctx context.Context, s settings, r asynq.RedisClientOpt) (EnqueueReport, error) {
	rep := EnqueueReport{Jobs: s.enqueueJobs, PerTx: enqueueBatch}
	for i := range s.rounds {
		fmt.Fprintf(os.Stderr, "enqueue round %d of %d: keel…", i+1, s.rounds)
		var rd EnqueueRound
		var err error
		rd.Keel, err = enqueueKeel(ctx, s, r)
		if err != nil {
			return rep, fmt.Errorf("keel enqueue: %w", err)
		}
		fmt.Fprintf(os.Stderr, " %.0f jobs/s", rd.Keel.JobsPerSecond)
		for _, m := range riverMethods {
			fmt.Fprintf(os.Stderr, "; River %s…", m)
			ph, err := enqueueRiver(ctx, s, m)
			if err != nil {
				return rep, fmt.Errorf("River %s: %w", m, err)
			}
			fmt.Fprintf(os.Stderr, " %.0f jobs/s", ph.JobsPerSecond)
			rd.River = append(rd.River, ph)
			rd.Ratios = append(rd.Ratios, rd.Keel.JobsPerSecond/ph.JobsPerSecond)
		}
		fmt.Fprintln(os.Stderr)
		rep.Rounds = append(rep.Rounds, rd)
	}
	for j, m := range riverMethods {
		ra := EnqueueRatio{River: m}
		for _, rd := range rep.Rounds {
			ra.Rounds = append(ra.Rounds, rd.Ratios[j])
		}
		sorted := slices.Clone(ra.Rounds)
		slices.SortFunc(sorted, cmp.Compare)
		ra.Median = sorted[(len(sorted)-1)/2]
		rep.Ratios = append(rep.Ratios, ra)
	}
	return rep, nil
}

// enqueueMeter is the effects part's meter plus the other processes' cores.
type enqueueMeter struct {
	cpu   meter
	noise bench.Noise
	start time.Time
}

func startEnqueueMeter() enqueueMeter {
	return enqueueMeter{cpu: startMeter(), noise: bench.StartNoise(), start: time.Now()}
}

func (m enqueueMeter) stop(p *EnqueuePhase) {
	p.Seconds = time.Since(m.start).Seconds()
	p.JobsPerSecond = float64(p.Jobs) / p.Seconds
	p.WorkerCPUms, p.PostgresCPUms, p.RedisCPUms = m.cpu.perJob(p.Jobs)
	p.OtherCores = m.noise.Stop()
}

func enqueueTimeout(ctx context.Context, n int) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, enqueuePhaseTimeoutMin+time.Duration(n)*time.Millisecond)
}

// enqueueKeel is keel bench's measureBulk for EnqueueManyTx, against the
// effects part's job: a relay runs from before the clock starts, and the
// clock stops when it has published every job.
func enqueueKeel(ctx context.Context, s settings, r asynq.RedisClientOpt) (EnqueuePhase, error) {
	ph := EnqueuePhase{System: "keel", Method: MethodKeel, Jobs: s.enqueueJobs, OtherCores: -1}
	ctx, cancel := enqueueTimeout(ctx, ph.Jobs)
	defer cancel()
	// Leave keel's queue empty for whatever runs next, on success or not.
	defer emptyQueue(r, true) //nolint:errcheck // best effort; the next phase's check reports a leftover
	if err := emptyQueue(r, true); err != nil {
		return ph, err
	}
	pool, err := freshPool(ctx, s, keelSchema)
	if err != nil {
		return ph, err
	}
	defer pool.Close()
	if _, err := migrate.Up(ctx, pool); err != nil {
		return ph, err
	}
	quiet := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	client, err := tasks.NewClient(tasks.ClientConfig{Redis: r, Pool: pool, Logger: quiet})
	if err != nil {
		return ph, err
	}
	defer client.Close()

	relay, err := outbox.NewRelay(outbox.RelayConfig{Pool: pool, Redis: r, Logger: quiet})
	if err != nil {
		return ph, err
	}
	rctx, stopRelay := context.WithCancel(ctx)
	relayDone := make(chan error, 1)
	go func() { relayDone <- relay.Run(rctx) }()
	defer func() { stopRelay(); <-relayDone; relay.Close() }()
	// Not timed: a relay that is not listening yet would find the first
	// commit only at its next poll, which measures the start-up.
	for !relay.Listening() {
		if ctx.Err() != nil {
			return ph, fmt.Errorf("relay not listening: %w", ctx.Err())
		}
		time.Sleep(time.Millisecond)
	}

	m := startEnqueueMeter()
	for i := 0; i < ph.Jobs; i += enqueueBatch {
		ts := make([]*tasks.Task, 0, enqueueBatch)
		for j := i; j < min(ph.Jobs, i+enqueueBatch); j++ {
			ts = append(ts, effectTask.New(effect{Key: fmt.Sprintf(enqueueKeyFormat, j)}))
		}
		if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			_, err := client.EnqueueManyTx(ctx, tx, ts...)
			return err
		}); err != nil {
			return ph, err
		}
	}
	for relay.Published() < uint64(ph.Jobs) {
		if ctx.Err() != nil {
			return ph, fmt.Errorf("%d of %d jobs published: %w", relay.Published(), ph.Jobs, ctx.Err())
		}
		time.Sleep(time.Millisecond)
	}
	m.stop(&ph)

	insp := asynq.NewInspector(r)
	defer insp.Close()
	info, err := insp.GetQueueInfo(effectQueue)
	if err != nil {
		return ph, err
	}
	ph.Stored = info.Pending
	if ph.Stored != ph.Jobs {
		return ph, fmt.Errorf("%d jobs pending in Redis, want %d", ph.Stored, ph.Jobs)
	}
	return ph, nil
}

// enqueueRiver inserts the jobs with one of River's bulk methods through an
// insert-only client (no queues, no workers: nothing works the jobs).
func enqueueRiver(ctx context.Context, s settings, method string) (EnqueuePhase, error) {
	ph := EnqueuePhase{System: "River", Method: method, Jobs: s.enqueueJobs, OtherCores: -1}
	ctx, cancel := enqueueTimeout(ctx, ph.Jobs)
	defer cancel()
	pool, err := freshRiverPool(ctx, s)
	if err != nil {
		return ph, err
	}
	defer pool.Close()
	client, err := river.NewClient(riverpgxv5.New(pool), &river.Config{
		Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})),
	})
	if err != nil {
		return ph, err
	}
	var opts *river.InsertOpts
	if method == MethodRiverInsertUniq {
		opts = &river.InsertOpts{UniqueOpts: river.UniqueOpts{ByArgs: true}}
	}

	m := startEnqueueMeter()
	for i := 0; i < ph.Jobs; i += enqueueBatch {
		params := make([]river.InsertManyParams, 0, enqueueBatch)
		for j := i; j < min(ph.Jobs, i+enqueueBatch); j++ {
			params = append(params, river.InsertManyParams{Args: effect{Key: fmt.Sprintf(enqueueKeyFormat, j)}, InsertOpts: opts})
		}
		if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			if method == MethodRiverInsertFast {
				_, err := client.InsertManyFastTx(ctx, tx, params)
				return err
			}
			res, err := client.InsertManyTx(ctx, tx, params)
			for _, r := range res {
				if err == nil && r.UniqueSkippedAsDuplicate {
					err = fmt.Errorf("job %d skipped as a duplicate", r.Job.ID)
				}
			}
			return err
		}); err != nil {
			return ph, err
		}
	}
	m.stop(&ph)

	// The unique row must really have gone through River's unique path.
	stored := `SELECT count(*) FROM river_job WHERE state = 'available'`
	if method == MethodRiverInsertUniq {
		stored += ` AND unique_key IS NOT NULL`
	}
	if err := pool.QueryRow(ctx, stored).Scan(&ph.Stored); err != nil {
		return ph, err
	}
	if ph.Stored != ph.Jobs {
		return ph, fmt.Errorf("%d jobs available in river_job (%s), want %d", ph.Stored, stored, ph.Jobs)
	}
	return ph, nil
}

// freshRiverPool is freshPool with River's tables migrated in.
func freshRiverPool(ctx context.Context, s settings) (*pgxpool.Pool, error) {
	pool, err := freshPool(ctx, s, riverSchema)
	if err != nil {
		return nil, err
	}
	migrator, err := rivermigrate.New(riverpgxv5.New(pool), &rivermigrate.Config{Logger: slog.New(slog.DiscardHandler)})
	if err == nil {
		_, err = migrator.Migrate(ctx, rivermigrate.DirectionUp, nil)
	}
	if err != nil {
		pool.Close()
		return nil, fmt.Errorf("migrate: %w", err)
	}
	return pool, nil
}
