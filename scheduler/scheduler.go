package scheduler

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/keeljobs/keel/internal/cronspec"
	"github.com/keeljobs/keel/internal/testsignal"
	"github.com/keeljobs/keel/tasks"
)

const (
	// maxSleep bounds one wait, so a wall clock that jumps is noticed.
	maxSleep = 30 * time.Second
	// Backoff after a failed enqueue or state read: doubling from
	// retryBase, at most retryCap.
	retryBase = time.Second
	retryCap  = 30 * time.Second
	// enqueueTimeout bounds one tick's enqueue, so a hung database stalls
	// the other entries for no longer.
	enqueueTimeout = 10 * time.Second
)

// Scheduler enqueues its entries' ticks through the ledger. Any number of
// instances may run the same entries: each enqueues every tick under the
// tick's business key (TickKey) and the ledger keeps one job per key.
type Scheduler struct {
	cfg   Config
	log   *slog.Logger
	store store

	mu sync.Mutex
	// entries are those Run runs: config's, then the ledger's whose names
	// config does not take.
	entries []compiled
	config  []compiled      // from Config.Entries, the file, SetEntries
	ledger  []compiled      // added at run time, as last read
	paused  map[string]bool // entries paused in the ledger, as last read
	// pausesRead: paused has been read from the ledger once. Until then no
	// entry fires: any may be paused.
	pausesRead bool
	changed    chan struct{} // wakes Run after the entries change

	pollMu   sync.Mutex      // serialises Refresh: the poller and callers
	rejected map[string]bool // run-time entries this scheduler cannot run, as last logged
	pollErr  string          // the last poll's failure, as logged

	reloadMu sync.Mutex // serialises Reload: SIGHUP and the file watcher
	stamp    fileStamp  // the File as last read

	running                 atomic.Bool
	fired, existed, failing atomic.Uint64
	reloaded, refused       atomic.Uint64
	skipped                 atomic.Uint64

	signals testSignals
}

// testSignals tell tests what Run did, so they wait on it rather than on
// the clock; off in production (see export_test.go).
type testSignals struct {
	// Looked is the time of each step of Run, sent once every tick due by
	// then is enqueued and recorded, and the next wake-up chosen.
	Looked testsignal.Signal[time.Time]
	// Synced names the entries Run runs, each time it takes changed
	// entries on; their ticks count from then.
	Synced testsignal.Signal[[]string]
	// Reloaded is the outcome of each Reload, the file watcher's included.
	Reloaded testsignal.Signal[error]
	// Polled is the outcome of each read of the ledger's run-time entries
	// and pauses, the poller's and Refresh's.
	Polled testsignal.Signal[error]
}

// New checks cfg (reading cfg.File if given) and returns a scheduler; Run
// starts it.
func New(cfg Config) (*Scheduler, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	s := &Scheduler{
		cfg:     cfg,
		log:     cfg.Logger,
		store:   store{pool: cfg.Client.Pool()},
		changed: make(chan struct{}, 1),
	}
	entries := cfg.Entries
	if cfg.File != "" {
		stamp, err := statFile(cfg.File)
		if err != nil {
			return nil, fmt.Errorf("schedule file: %w", err)
		}
		if entries, err = LoadFile(cfg.File); err != nil {
			return nil, err
		}
		s.stamp = stamp
	}
	if _, err := s.setEntries(entries); err != nil {
		if cfg.File != "" {
			err = fmt.Errorf("%s: %w", cfg.File, err)
		}
		return nil, err
	}
	return s, nil
}

// Entries returns the entries the scheduler runs now: its own (Config.Entries,
// the file, SetEntries), then those added at run time in the ledger, paused
// ones included.
func (s *Scheduler) Entries() []Entry {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]Entry, len(s.entries))
	for i, c := range s.entries {
		out[i] = c.Entry
	}
	return out
}

// SetEntries replaces the entries while the scheduler runs. A set with any
// invalid entry is refused whole and the running entries stay. An entry
// whose Spec and TimeZone are unchanged keeps its place in its schedule; a
// changed one starts afresh, with no missed ticks.
func (s *Scheduler) SetEntries(entries []Entry) error {
	diff, err := s.setEntries(entries)
	if err != nil {
		return err
	}
	s.log.Info("keel scheduler: entries replaced", "added", diff.added, "changed", diff.changed, "removed", diff.removed)
	return nil
}

type entryDiff struct{ added, changed, removed []string }

func (s *Scheduler) setEntries(entries []Entry) (entryDiff, error) {
	cs, err := compileAll(entries, s.cfg.KnownKind)
	if err != nil {
		return entryDiff{}, err
	}
	for i, c := range cs {
		if _, err := s.check(c.Entry); err != nil {
			err.(*EntryError).Index = i + 1
			return entryDiff{}, err
		}
	}
	s.mu.Lock()
	old := s.config
	s.config = cs
	s.merge()
	s.mu.Unlock()
	s.wake()
	var d entryDiff
	for _, c := range cs {
		i := slices.IndexFunc(old, func(o compiled) bool { return o.Name == c.Name })
		switch {
		case i < 0:
			d.added = append(d.added, c.Name)
		case !equalEntry(old[i].Entry, c.Entry):
			d.changed = append(d.changed, c.Name)
		}
	}
	for _, o := range old {
		if !slices.ContainsFunc(cs, func(c compiled) bool { return c.Name == o.Name }) {
			d.removed = append(d.removed, o.Name)
		}
	}
	return d, nil
}

// merge sets entries from config and ledger; s.mu is held. A run-time
// entry whose name a configured one has is left out: the configuration is
// what a deploy reviewed.
func (s *Scheduler) merge() {
	all := slices.Clone(s.config)
	for _, c := range s.ledger {
		if !slices.ContainsFunc(s.config, func(o compiled) bool { return o.Name == c.Name }) {
			all = append(all, c)
		}
	}
	s.entries = all
}

// wake tells Run that the entries or pauses changed.
func (s *Scheduler) wake() {
	select {
	case s.changed <- struct{}{}:
	default:
	}
}

func equalEntry(a, b Entry) bool {
	sameRetry := (a.MaxRetry == nil) == (b.MaxRetry == nil) && (a.MaxRetry == nil || *a.MaxRetry == *b.MaxRetry)
	return a.Name == b.Name && a.Spec == b.Spec && a.TimeZone == b.TimeZone && a.Kind == b.Kind &&
		string(a.Payload) == string(b.Payload) && a.Queue == b.Queue && sameRetry && a.Timeout == b.Timeout
}

// Reload reads Config.File again and runs its entries (SIGHUP calls it in
// keel scheduler). A file that does not load is logged and returned, and the
// running entries stay.
func (s *Scheduler) Reload() error {
	if s.cfg.File == "" {
		return errors.New("keel scheduler: no schedule file to reload")
	}
	s.reloadMu.Lock()
	defer s.reloadMu.Unlock()
	d, err := s.reload()
	if err != nil {
		s.refused.Add(1)
		s.log.Error("keel scheduler: schedule not reloaded; the running entries stay", "file", s.cfg.File, "err", err)
		s.signals.Reloaded.Signal(err)
		return err
	}
	s.reloaded.Add(1)
	s.log.Info("keel scheduler: schedule reloaded", "file", s.cfg.File, "entries", len(s.Entries()),
		"added", d.added, "changed", d.changed, "removed", d.removed)
	s.signals.Reloaded.Signal(nil)
	return nil
}

func (s *Scheduler) reload() (entryDiff, error) {
	stamp, err := statFile(s.cfg.File)
	if err != nil {
		return entryDiff{}, fmt.Errorf("schedule file: %w", err)
	}
	// Remembered even if the file is bad: a broken file is reported once, not
	// at every check, and the fix changes the stamp again.
	s.stamp = stamp
	entries, err := LoadFile(s.cfg.File)
	if err != nil {
		return entryDiff{}, err
	}
	d, err := s.setEntries(entries)
	if err != nil {
		return entryDiff{}, fmt.Errorf("%s: %w", s.cfg.File, err)
	}
	return d, nil
}

// Stats counts what the scheduler did since it was made.
type Stats struct {
	// Enqueued ticks: jobs this instance created.
	Enqueued uint64
	// Existed ticks: enqueued by another instance (or an earlier run) first;
	// the ledger returned their job and nothing was created.
	Existed uint64
	// Failed enqueues, each retried with backoff.
	Failed uint64
	// Reloads of the schedule file that took, and those refused (the file
	// did not load; the running entries stayed).
	Reloads, ReloadsRefused uint64
	// Paused ticks: handled without a job, their entry paused in the ledger.
	Paused uint64
}

// Stats returns the scheduler's counters.
func (s *Scheduler) Stats() Stats {
	return Stats{Enqueued: s.fired.Load(), Existed: s.existed.Load(), Failed: s.failing.Load(),
		Reloads: s.reloaded.Load(), ReloadsRefused: s.refused.Load(), Paused: s.skipped.Load()}
}

// Run enqueues ticks until ctx is done, then returns nil. It returns an
// error only when called while already running.
func (s *Scheduler) Run(ctx context.Context) error {
	if !s.running.CompareAndSwap(false, true) {
		return errors.New("keel scheduler: already running")
	}
	defer s.running.Store(false)
	var wg sync.WaitGroup
	defer wg.Wait()
	if s.cfg.File != "" {
		wg.Go(func() { s.watchFile(ctx) })
	}
	// Read before the first tick: a paused entry must not fire at start.
	_ = s.Refresh(ctx) // logs its failure; the poller tries again
	wg.Go(func() { s.pollLedger(ctx) })
	clock := s.cfg.Clock
	r := &run{s: s, states: map[string]*entryState{}}
	r.sync(clock.Now())
	s.log.Info("keel scheduler started", "entries", len(r.states), "missed_ticks", s.cfg.MissedTicks.String(),
		"max_catch_up", s.cfg.MaxCatchUp, "file", s.cfg.File)
	for {
		now := clock.Now()
		wake := r.step(ctx, now)
		s.signals.Looked.Signal(now)
		select {
		case <-ctx.Done():
			s.log.Info("keel scheduler stopped", "enqueued", s.fired.Load(), "existed", s.existed.Load())
			return nil
		case <-s.changed:
			r.sync(clock.Now())
			if s.signals.Synced.On() {
				var names []string
				for name, st := range r.states {
					if !st.paused {
						names = append(names, name)
					}
				}
				slices.Sort(names)
				s.signals.Synced.Signal(names)
			}
		case <-clock.At(wake):
		}
	}
}

// entryState is where one entry stands in its schedule on this instance.
type entryState struct {
	e compiled
	// since is when this instance took the entry on: a tick before it came
	// due while this instance was not running it.
	since time.Time
	// cursor is the newest tick handled; the ticks after it are pending.
	cursor time.Time
	// loaded says the cursor has been read from keel_schedule.
	loaded bool
	// paused: the ledger holds the entry paused; its ticks are handled
	// without a job, so a resume starts at the next tick.
	paused   bool
	retryAt  time.Time
	failures int
}

// run is the state of one Run.
type run struct {
	s      *Scheduler
	states map[string]*entryState
	// pausesKnown: the pauses the states hold were read from the ledger.
	pausesKnown bool
}

// sync brings the states in line with the scheduler's entries.
func (r *run) sync(now time.Time) {
	r.s.mu.Lock()
	cur, paused, known := r.s.entries, r.s.paused, r.s.pausesRead
	r.s.mu.Unlock()
	r.pausesKnown = known
	next := make(map[string]*entryState, len(cur))
	for _, c := range cur {
		st, ok := r.states[c.Name]
		switch {
		case ok && st.e.sameSchedule(c):
			st.e = c
		case ok:
			// A new schedule has no history: its ticks start now.
			st = &entryState{e: c, since: now, cursor: now, loaded: true}
		default:
			// Picks up where the fleet left off once keel_schedule is read.
			st = &entryState{e: c, since: now, cursor: now}
		}
		st.paused = paused[c.Name]
		next[c.Name] = st
	}
	r.states = next
}

// step handles every entry's due ticks at now and returns when to look
// again.
func (r *run) step(ctx context.Context, now time.Time) time.Time {
	r.load(ctx, now)
	wake := now.Add(maxSleep)
	for _, name := range slices.Sorted(maps.Keys(r.states)) {
		st := r.states[name]
		switch {
		case !r.pausesKnown:
			// Whether it is paused is not known yet: it waits, its ticks
			// missed meanwhile caught up by the policy once it is.
			continue
		case st.loaded && st.paused:
			r.skip(ctx, st, now)
		case st.loaded && !st.retryAt.After(now):
			r.fire(ctx, st, now)
		}
		w := st.retryAt
		if st.loaded && !w.After(now) {
			w = st.e.sched.Next(st.cursor)
		}
		if !w.IsZero() && w.Before(wake) {
			wake = w
		}
	}
	return wake
}

// load reads the newest handled tick of the entries that have not been
// read yet: ticks between it and their start were missed.
func (r *run) load(ctx context.Context, now time.Time) {
	var names, specs, zones []string
	var since []time.Time
	for name, st := range r.states {
		if !st.loaded && !st.retryAt.After(now) {
			names, specs, zones = append(names, name), append(specs, st.e.Spec), append(zones, st.e.TimeZone)
			since = append(since, st.since)
		}
	}
	if len(names) == 0 {
		return
	}
	ticks, err := r.s.store.load(ctx, names, since, specs, zones)
	for _, name := range names {
		st := r.states[name]
		if err != nil {
			st.backoff(now)
			continue
		}
		// A tick handled under another schedule (the entry changed while
		// no scheduler ran it) is no place in this one: it starts afresh.
		if m, ok := ticks[name]; ok && (m.Spec == "" || m.Spec == st.e.Spec && m.TimeZone == st.e.TimeZone) {
			st.cursor = m.Tick
		}
		st.loaded, st.retryAt, st.failures = true, time.Time{}, 0
	}
	if err != nil && ctx.Err() == nil {
		r.s.log.Error("keel scheduler: cannot read the schedule state; retrying", "entries", names, "err", err)
	}
}

func (st *entryState) backoff(now time.Time) {
	d := retryCap
	if st.failures < 5 {
		d = min(retryBase<<st.failures, retryCap)
	}
	st.failures++
	st.retryAt = now.Add(d)
}

// skip handles a paused entry's due ticks without a job: recorded as
// handled, so that neither a resume nor a restart catches them up.
func (r *run) skip(ctx context.Context, st *entryState, now time.Time) {
	due, _ := cronspec.RecentTicks(st.e.sched, st.cursor, now, 1)
	if len(due) == 0 {
		return
	}
	r.s.skipped.Add(1)
	r.s.log.Info("keel scheduler: tick skipped: the entry is paused", "entry", st.e.Name, "tick", due[0].UTC())
	st.failures, st.retryAt = 0, time.Time{}
	r.mark(ctx, st, due[0])
}

// fire enqueues st's due ticks as the missed-tick policy says: the newest
// due tick if it came due while this instance ran the entry, and with
// CatchUp up to MaxCatchUp missed ones before it, oldest first.
func (r *run) fire(ctx context.Context, st *entryState, now time.Time) {
	catchUp := 0
	if r.s.cfg.MissedTicks == CatchUp {
		catchUp = r.s.cfg.MaxCatchUp
	}
	due, more := cronspec.RecentTicks(st.e.sched, st.cursor, now, catchUp+1)
	if len(due) == 0 {
		return
	}
	newest := due[len(due)-1]
	missed, onTime := due, []time.Time(nil)
	if !newest.Before(st.since) {
		missed, onTime = due[:len(due)-1], due[len(due)-1:]
	}
	late := missed[max(len(missed)-catchUp, 0):]
	ticks := append(slices.Clip(late), onTime...)
	if len(late) < len(missed) || more {
		if len(ticks) == 0 {
			r.s.log.Warn("keel scheduler: missed ticks dropped", "entry", st.e.Name, "policy", r.s.cfg.MissedTicks.String(),
				"after", st.cursor.UTC(), "through", newest.UTC())
			r.mark(ctx, st, newest)
			return
		}
		r.s.log.Warn("keel scheduler: missed ticks dropped", "entry", st.e.Name, "policy", r.s.cfg.MissedTicks.String(),
			"after", st.cursor.UTC(), "before", ticks[0].UTC())
		// Every tick before ticks[0] is handled (dropped): a retry after a
		// failed enqueue must not drop, and log, them again.
		st.cursor = ticks[0].Add(-time.Nanosecond)
	}
	for i, tick := range ticks {
		if i < len(late) {
			r.s.log.Info("keel scheduler: catching up a missed tick", "entry", st.e.Name, "tick", tick.UTC())
		}
		if err := r.enqueue(ctx, st.e, tick); err != nil {
			if i > 0 {
				r.mark(ctx, st, ticks[i-1])
			}
			if ctx.Err() != nil {
				return // stopping: the tick is pending for the next start
			}
			r.s.failing.Add(1)
			st.backoff(now)
			r.s.log.Error("keel scheduler: tick not enqueued; retrying", "entry", st.e.Name, "tick", tick.UTC(),
				"retry_at", st.retryAt.UTC(), "err", err)
			return
		}
	}
	st.failures, st.retryAt = 0, time.Time{}
	r.mark(ctx, st, newest)
}

// mark moves st's cursor to tick and records it for the fleet. A failed
// write is only logged: the ledger still refuses a second job for a tick.
func (r *run) mark(ctx context.Context, st *entryState, tick time.Time) {
	if !tick.After(st.cursor) {
		return
	}
	st.cursor = tick
	// Recorded even when Run is stopping: the ticks were handled.
	mctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), enqueueTimeout)
	defer cancel()
	if err := r.s.store.markTick(mctx, st.e.Name, tick); err != nil {
		r.s.log.Warn("keel scheduler: last tick not recorded", "entry", st.e.Name, "tick", tick.UTC(), "err", err)
	}
}

// Options are the task options an entry's ticks are enqueued with.
func (e Entry) Options() []tasks.Option {
	var opts []tasks.Option
	if e.Queue != "" {
		opts = append(opts, tasks.Queue(e.Queue))
	}
	if e.MaxRetry != nil {
		opts = append(opts, tasks.MaxRetry(*e.MaxRetry))
	}
	if e.Timeout > 0 {
		opts = append(opts, tasks.Timeout(e.Timeout))
	}
	return opts
}

// task is what the entry enqueues under key. A tick's key dedupes for as
// long as the ledger keeps its job, whatever window the kind's tasks.Unique
// sets: a scheduler catching up a tick that already ran (its keel_schedule
// row stale, or another scheduler's) must find that job, not run the tick
// again.
func (e Entry) task(kinds *tasks.Kinds, key string) *tasks.Task {
	return kinds.NewRaw(e.Kind, e.Payload, key, append(e.Options(), tasks.Unique(0))...)
}

func (r *run) enqueue(ctx context.Context, e compiled, tick time.Time) error {
	key := TickKey(e.Name, tick)
	ectx, cancel := context.WithTimeout(ctx, enqueueTimeout)
	defer cancel()
	res, err := r.s.cfg.Client.Enqueue(ectx, e.task(r.s.cfg.Kinds, key))
	if err != nil {
		return err
	}
	if res.Existed {
		r.s.existed.Add(1)
		r.s.log.Debug("keel scheduler: tick already enqueued", "entry", e.Name, "tick", tick.UTC(), "job_id", res.Job.ID)
		return nil
	}
	r.s.fired.Add(1)
	r.s.log.Info("keel scheduler: tick enqueued", "entry", e.Name, "tick", tick.UTC(), "kind", e.Kind,
		"job_id", res.Job.ID, "business_key", key)
	return nil
}

// fileStamp is what tells a changed file: modification time and size.
type fileStamp struct {
	mod  time.Time
	size int64
}

func (a fileStamp) same(b fileStamp) bool { return a.mod.Equal(b.mod) && a.size == b.size }

func statFile(path string) (fileStamp, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return fileStamp{}, err
	}
	return fileStamp{mod: fi.ModTime(), size: fi.Size()}, nil
}

// watchFile reloads the schedule when its file changes, polling its stamp:
// portable, and no dependency for something checked every few seconds.
func (s *Scheduler) watchFile(ctx context.Context) {
	t := time.NewTicker(s.cfg.FileCheckInterval)
	defer t.Stop()
	var lastErr string
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		stamp, err := statFile(s.cfg.File)
		if err != nil {
			if err.Error() != lastErr {
				s.log.Error("keel scheduler: schedule file unreadable; the running entries stay", "file", s.cfg.File, "err", err)
			}
			lastErr = err.Error()
			continue
		}
		lastErr = ""
		s.reloadMu.Lock()
		same := stamp.same(s.stamp)
		s.reloadMu.Unlock()
		if !same {
			_ = s.Reload() // logs its outcome
		}
	}
}
