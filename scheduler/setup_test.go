package scheduler_test

import (
	"context"
	"log/slog"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/internal/testenv"
	"github.com/keeljobs/keel/scheduler"
	"github.com/keeljobs/keel/tasks"
)

type tickPayload struct {
	Note string `json:"note"`
}

// tickKind is the kind the test entries enqueue.
var tickKind = tasks.Define[tickPayload]("test:scheduler_tick",
	tasks.Key(func(p tickPayload) string { return p.Note }))

// testKinds are the kinds of the program under test.
var testKinds = tasks.NewKinds(tickKind, uniqueTick, lowTick)

type bundle struct {
	pool  *pgxpool.Pool
	redis asynq.RedisClientOpt
}

// setup gives the test a Redis and a ledger schema of its own, and runs it
// in parallel with the package's other tests.
func setup(t *testing.T) *bundle {
	t.Helper()
	t.Parallel()
	pool, _ := testenv.PrivatePool(t)
	return &bundle{redis: asynq.RedisClientOpt{Addr: testenv.StartRedis(t).Addr()}, pool: pool}
}

// client returns a tasks client of its own, as each scheduler process has.
func (b *bundle) client(t *testing.T) *tasks.Client {
	t.Helper()
	c, err := tasks.NewClient(tasks.ClientConfig{Redis: b.redis, Pool: b.pool, Logger: testLogger(t)})
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	return c
}

// instance is one running scheduler.
type instance struct {
	*scheduler.Scheduler
	signals *scheduler.TestSignals
	stop    func()
}

// start runs a scheduler on cfg (with a client of its own unless cfg has
// one) until stop or the end of the test. It returns once the scheduler has
// looked at its start time: ticks due then are handled, and the clock may
// move.
func (b *bundle) start(t *testing.T, cfg scheduler.Config) *instance {
	t.Helper()
	if cfg.Client == nil {
		cfg.Client = b.client(t)
	}
	if cfg.Logger == nil {
		cfg.Logger = testLogger(t)
	}
	if cfg.Kinds == nil {
		cfg.Kinds = testKinds
	}
	s, err := scheduler.New(cfg)
	require.NoError(t, err)
	signals := scheduler.InitTestSignals(s)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	var once sync.Once
	stop := func() {
		once.Do(func() {
			cancel()
			require.NoError(t, <-done)
		})
	}
	t.Cleanup(stop)
	signals.Looked.Wait(t)
	return &instance{Scheduler: s, signals: signals, stop: stop}
}

// looked waits until in has handled every tick due at at.
func (in *instance) looked(t *testing.T, at time.Time) {
	t.Helper()
	in.signals.Looked.WaitFor(t, func(now time.Time) bool { return !now.Before(at) })
}

// advance moves clock to at, and waits until each of ins has handled the
// ticks due by then.
func advance(t *testing.T, clock *fakeClock, at time.Time, ins ...*instance) {
	t.Helper()
	clock.Set(at)
	for _, in := range ins {
		in.looked(t, at)
	}
}

// runUntil moves clock to until through every whole second between,
// waiting at each until ins have handled its tick. Between seconds nothing
// is due and no scheduler wakes, so a move to until mid-second is not
// waited on.
func runUntil(t *testing.T, clock *fakeClock, until time.Time, ins ...*instance) {
	t.Helper()
	for at := clock.Now().Truncate(time.Second).Add(time.Second); !at.After(until); at = at.Add(time.Second) {
		advance(t, clock, at, ins...)
	}
	clock.Set(until)
}

// ticks returns the ticks of entry that have a ledger job, oldest first,
// failing the test if a tick has more than one.
func (b *bundle) ticks(t *testing.T, entry string) []time.Time {
	t.Helper()
	rows, err := b.pool.Query(context.Background(),
		`SELECT business_key, count(*) FROM keel_jobs WHERE kind = $1 AND business_key LIKE $2 GROUP BY business_key`,
		tickKind.Name(), "cron:"+entry+":%")
	require.NoError(t, err)
	defer rows.Close()
	var out []time.Time
	for rows.Next() {
		var key string
		var n int
		require.NoError(t, rows.Scan(&key, &n))
		require.Equal(t, 1, n, "jobs for %s", key)
		tick, err := time.Parse(time.RFC3339, strings.TrimPrefix(key, "cron:"+entry+":"))
		require.NoError(t, err, key)
		require.Equal(t, scheduler.TickKey(entry, tick), key)
		out = append(out, tick)
	}
	require.NoError(t, rows.Err())
	sort.Slice(out, func(i, j int) bool { return out[i].Before(out[j]) })
	return out
}

// pending is how many tasks wait in Redis queue q.
func (b *bundle) pending(t *testing.T, q string) int {
	t.Helper()
	insp := asynq.NewInspector(b.redis)
	defer insp.Close()
	info, err := insp.GetQueueInfo(q)
	require.NoError(t, err)
	return info.Pending
}

// testLogger shows warnings and errors in the test's output.
func testLogger(t *testing.T) *slog.Logger {
	return slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelWarn}))
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Helper()
	w.t.Log(strings.TrimSuffix(string(p), "\n"))
	return len(p), nil
}

// fakeClock is a Clock the test moves by hand.
type fakeClock struct {
	mu      sync.Mutex
	now     time.Time
	waiters []fakeWaiter
}

type fakeWaiter struct {
	at time.Time
	ch chan time.Time
}

func newFakeClock(now time.Time) *fakeClock { return &fakeClock{now: now} }

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *fakeClock) At(t time.Time) <-chan time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	ch := make(chan time.Time, 1)
	if !t.After(c.now) {
		ch <- c.now
		return ch
	}
	c.waiters = append(c.waiters, fakeWaiter{at: t, ch: ch})
	return ch
}

// Set moves the clock to now, waking what waits until then.
func (c *fakeClock) Set(now time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = now
	kept := c.waiters[:0]
	for _, w := range c.waiters {
		if w.at.After(now) {
			kept = append(kept, w)
			continue
		}
		w.ch <- now
	}
	c.waiters = kept
}
