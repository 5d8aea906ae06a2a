package bench

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"runtime"
	"slices"
	"strings"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/keeljobs/keel/internal/asynqwire"
	"github.com/keeljobs/keel/internal/ledger"
)

// The parts Run can measure, in the order it measures them.
const (
	PartProcessing = "processing"
	PartEnqueue    = "enqueue"
	PartLatency    = "latency"
	PartRelay      = "relay"
	PartRecovery   = "recovery"
	PartRedelivery = "redelivery"
	PartMemory     = "memory"
	// PartScale loads millions of rows and takes minutes: it runs only
	// when named.
	PartScale = "scale"
)

// AllParts lists the parts Run measures when none is named, in its order.
func AllParts() []string {
	return []string{PartProcessing, PartEnqueue, PartLatency, PartRelay, PartRecovery, PartRedelivery, PartMemory}
}

// KnownParts lists every part, in the order Run measures them: AllParts,
// then those that run only when named.
func KnownParts() []string { return append(AllParts(), PartScale) }

// selectParts returns the parts named, in Run's order, or AllParts.
func selectParts(names []string) ([]string, error) {
	if len(names) == 0 {
		return AllParts(), nil
	}
	want := map[string]bool{}
	for _, n := range names {
		n = strings.TrimSpace(strings.ToLower(n))
		if n == "" {
			continue
		}
		if !slices.Contains(KnownParts(), n) {
			return nil, fmt.Errorf("keel bench: unknown part %q (parts: %s)", n, strings.Join(KnownParts(), ", "))
		}
		want[n] = true
	}
	var parts []string
	for _, p := range KnownParts() {
		if want[p] {
			parts = append(parts, p)
		}
	}
	if len(parts) == 0 {
		return nil, errors.New("keel bench: no part selected")
	}
	return parts, nil
}

// Env describes where a run took place.
type Env struct {
	Cores     int    `json:"cores"`
	CPU       string `json:"cpu,omitempty"`
	GoVersion string `json:"go"`
	OS        string `json:"os"`
	Arch      string `json:"arch"`
	// Redis and Postgres are the servers' versions.
	Redis     string    `json:"redis"`
	Postgres  string    `json:"postgres"`
	RedisAddr string    `json:"redis_addr"`
	RedisDB   int       `json:"redis_db"`
	Quick     bool      `json:"quick"`
	Started   time.Time `json:"started"`
	// Seconds is how long the whole run took.
	Seconds float64 `json:"seconds"`
	// OtherCores is how many cores, on average over the run, processes other
	// than this one (and its children), Redis and Postgres kept busy: the
	// noise the figures carry. Negative when unknown.
	OtherCores float64 `json:"other_cores_busy"`
}

// String is the header line of a report.
func (e Env) String() string {
	cpu := ""
	if e.CPU != "" {
		cpu = " (" + e.CPU + ")"
	}
	return fmt.Sprintf("%d cores%s, %s %s/%s, Redis %s (%s db %d), Postgres %s",
		e.Cores, cpu, e.GoVersion, e.OS, e.Arch, e.Redis, e.RedisAddr, e.RedisDB, e.Postgres)
}

// PartError is a part that failed or was skipped, and why.
type PartError struct {
	Part  string `json:"part"`
	Error string `json:"error"`
}

// Results is what Run measured. A part that was not selected is nil; a
// part that failed keeps what it measured before it failed and is named in
// Errors.
type Results struct {
	Env        Env               `json:"env"`
	Parts      []string          `json:"parts"`
	Processing *Report           `json:"processing,omitempty"`
	Enqueue    *EnqueueReport    `json:"enqueue,omitempty"`
	Latency    *LatencyReport    `json:"latency,omitempty"`
	Relay      *RelayReport      `json:"relay,omitempty"`
	Recovery   *RecoveryReport   `json:"recovery,omitempty"`
	Redelivery *RedeliveryReport `json:"redelivery,omitempty"`
	Memory     *MemoryReport     `json:"memory,omitempty"`
	Scale      *ScaleReport      `json:"scale,omitempty"`
	Errors     []PartError       `json:"errors,omitempty"`
}

// String renders the results as tables, one per part.
func (r Results) String() string {
	var sb strings.Builder
	fmt.Fprintf(&sb, "keel bench: %s\n", r.Env)
	section := func(title string, body fmt.Stringer) {
		fmt.Fprintf(&sb, "\n== %s\n\n%s", title, strings.TrimRight(body.String(), "\n")+"\n")
	}
	if r.Processing != nil {
		section("processing: no-op jobs, plain asynq vs keel", r.Processing)
	}
	if r.Enqueue != nil {
		section("enqueue", r.Enqueue)
	}
	if r.Latency != nil {
		section("latency: commit → handler start, idle worker", r.Latency)
	}
	if r.Relay != nil {
		section("relay: publishing committed rows", r.Relay)
	}
	if r.Recovery != nil {
		section("recovery: Redis loses every queued job", r.Recovery)
	}
	if r.Redelivery != nil {
		section("redelivery: a worker killed mid-job", r.Redelivery)
	}
	if r.Memory != nil {
		section("memory: worker resident size", r.Memory)
	}
	if r.Scale != nil {
		section("scale: the ledger with millions of finished jobs", r.Scale)
	}
	for _, e := range r.Errors {
		fmt.Fprintf(&sb, "\n%s: %s\n", e.Part, e.Error)
	}
	fmt.Fprintf(&sb, "\ntook %.0fs", r.Env.Seconds)
	if r.Env.OtherCores >= 0 {
		fmt.Fprintf(&sb, "; other processes kept %.2f of %d cores busy meanwhile", r.Env.OtherCores, r.Env.Cores)
	}
	fmt.Fprintln(&sb)
	return sb.String()
}

// Run measures the parts opts.Parts selects (all by default), one after the
// other, and returns what it measured; the error joins those of the parts
// that failed. It drops and recreates opts.Schema, empties the benchmark's
// queues in its Redis database between parts, and refuses to start when
// they hold tasks.
func Run(ctx context.Context, opts Options) (Results, error) {
	o := opts.withDefaults()
	res := Results{Env: Env{Cores: runtime.NumCPU(), CPU: cpuModel(), GoVersion: runtime.Version(), OS: runtime.GOOS,
		Arch: runtime.GOARCH, RedisAddr: o.RedisAddr, RedisDB: o.RedisDB, Quick: o.Quick, Started: time.Now(), OtherCores: -1}}
	parts, err := selectParts(o.Parts)
	if err != nil {
		return res, err
	}
	e, err := open(ctx, o)
	if err != nil {
		return res, err
	}
	res.Parts = parts
	defer e.close()
	res.Env.Redis, res.Env.Postgres = e.versions(ctx)
	noise := startNoise()

	var errs []error
	for i, p := range parts {
		if ctx.Err() != nil {
			break
		}
		e.part, e.index, e.parts = p, i+1, len(parts)
		err := e.reset(ctx)
		if err == nil {
			err = e.runPart(ctx, p, &res)
		}
		if err != nil {
			res.Errors = append(res.Errors, PartError{Part: p, Error: err.Error()})
			errs = append(errs, fmt.Errorf("%s: %w", p, err))
		}
	}
	// Leave the queues empty for the next run, even after an interrupt.
	cleanup, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	if err := e.reset(cleanup); err != nil {
		errs = append(errs, err)
	}
	res.Env.Seconds = time.Since(res.Env.Started).Seconds()
	res.Env.OtherCores = noise.stop()
	if ctx.Err() != nil {
		errs = append(errs, ctx.Err())
	}
	return res, errors.Join(errs...)
}

func (e *env) runPart(ctx context.Context, p string, res *Results) error {
	switch p {
	case PartProcessing:
		r, err := e.processing(ctx)
		res.Processing = &r
		return err
	case PartEnqueue:
		r, err := e.enqueueRates(ctx)
		res.Enqueue = &r
		return err
	case PartLatency:
		r, err := e.latency(ctx)
		res.Latency = &r
		return err
	case PartRelay:
		r, err := e.relay(ctx)
		res.Relay = &r
		return err
	case PartRecovery:
		r, err := e.recovery(ctx)
		res.Recovery = &r
		return err
	case PartRedelivery:
		r, err := e.redelivery(ctx)
		res.Redelivery = &r
		return err
	case PartMemory:
		r, err := e.memory(ctx)
		res.Memory = &r
		return err
	case PartScale:
		r, err := e.scale(ctx)
		res.Scale = &r
		return err
	}
	return fmt.Errorf("keel bench: unknown part %q", p)
}

// env is what every part shares: the options, the benchmark's Redis
// database and the ledger's pool.
type env struct {
	o     Options
	redis asynq.RedisClientOpt
	pool  *pgxpool.Pool
	// warn is the workers' logger: warnings and errors only.
	warn *slog.Logger

	// The part being measured, for progress reports, and which of its
	// rounds when it has several.
	part         string
	index, parts int
	roundLabel   string
}

func open(ctx context.Context, o Options) (*env, error) {
	if o.Schema == "public" {
		return nil, errors.New("keel bench: refusing to drop schema public; name a schema of the benchmark's own")
	}
	r := asynq.RedisClientOpt{Addr: o.RedisAddr, DB: o.RedisDB, Password: o.RedisPassword}
	if err := checkQueuesEmpty(r); err != nil {
		return nil, err
	}
	pool, err := ledgerPool(ctx, o)
	if err != nil {
		return nil, err
	}
	return &env{o: o, redis: r, pool: pool, warn: slog.New(levelAtLeast{o.Logger.Handler(), slog.LevelWarn})}, nil
}

func (e *env) close() { e.pool.Close() }

// truncate empties the ledger.
func (e *env) truncate(ctx context.Context) error {
	return ledger.EmptyLedger(ctx, e.pool)
}

// reset empties the ledger and the benchmark's queues.
func (e *env) reset(ctx context.Context) error {
	if err := e.truncate(ctx); err != nil {
		return err
	}
	return clearQueues(e.redis)
}

// clearQueues deletes the benchmark's queues (Queues) and every task in
// them from the Redis database r, and resumes them if a run that stopped
// half-way left one paused.
func clearQueues(r asynq.RedisClientOpt) error {
	if err := registerQueues(r); err != nil {
		return err
	}
	insp := asynq.NewInspector(r)
	defer insp.Close()
	for q := range Queues() {
		_ = insp.UnpauseQueue(q) // an error means it was not paused
		err := insp.DeleteQueue(q, true)
		if err != nil && !errors.Is(err, asynq.ErrQueueNotFound) {
			return fmt.Errorf("keel bench: empty queue %s: %w", q, err)
		}
	}
	return nil
}

// versions asks the servers for their versions.
func (e *env) versions(ctx context.Context) (redisVersion, pgVersion string) {
	rc := redis.NewClient(&redis.Options{Addr: e.redis.Addr, DB: e.redis.DB, Password: e.redis.Password})
	defer rc.Close()
	redisVersion = "?"
	if info, err := rc.Info(ctx, "server").Result(); err == nil {
		for line := range strings.SplitSeq(info, "\n") {
			if v, ok := strings.CutPrefix(strings.TrimSpace(line), "redis_version:"); ok {
				redisVersion = v
			}
		}
	}
	pgVersion = "?"
	if err := e.pool.QueryRow(ctx, `SHOW server_version`).Scan(&pgVersion); err == nil {
		pgVersion, _, _ = strings.Cut(pgVersion, " ")
	}
	return redisVersion, pgVersion
}

// cpuModel is the processor's name, where /proc/cpuinfo tells it.
func cpuModel() string {
	f, err := os.Open("/proc/cpuinfo")
	if err != nil {
		return ""
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), ":")
		if ok && strings.TrimSpace(k) == "model name" {
			return strings.Join(strings.Fields(v), " ")
		}
	}
	return ""
}

// registerQueues lists the benchmark's queues in Redis as existing. An
// asynq.Client adds a queue to that list only the first time it enqueues
// to it, so once a queue has been deleted, a client that had used it
// fills it again without listing it, and the Inspector (which the queue
// checks and clearQueues use) then takes the queue for absent, tasks and
// all.
func registerQueues(r asynq.RedisClientOpt) error {
	rc := redis.NewClient(&redis.Options{Addr: r.Addr, DB: r.DB, Password: r.Password})
	defer rc.Close()
	names := make([]any, 0, len(Queues()))
	for q := range Queues() {
		names = append(names, q)
	}
	if err := rc.SAdd(context.Background(), asynqwire.QueuesKey, names...).Err(); err != nil {
		return fmt.Errorf("keel bench: Redis at %s: %w", r.Addr, err)
	}
	return nil
}
