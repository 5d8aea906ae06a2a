package scheduler

import (
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/keeljobs/keel/tasks"
)

// MissedTicks says what happens to ticks that no scheduler enqueued in time:
// ticks that came due while every instance was stopped, and ticks overtaken
// by the entry's next tick while the ledger could not be written.
type MissedTicks int

const (
	// CatchUp enqueues the MaxCatchUp most recent missed ticks of an entry,
	// oldest first, late, and drops older ones. It is the default, with
	// MaxCatchUp 1: after an outage a nightly job runs once, late, rather
	// than not at all or once per night lost.
	CatchUp MissedTicks = iota
	// Skip drops missed ticks: the entry runs again at its next tick.
	Skip
)

func (m MissedTicks) String() string {
	switch m {
	case CatchUp:
		return "catch-up"
	case Skip:
		return "skip"
	}
	return fmt.Sprintf("MissedTicks(%d)", int(m))
}

// ParseMissedTicks reads "catch-up" or "skip".
func ParseMissedTicks(s string) (MissedTicks, error) {
	switch s {
	case "catch-up", "catchup", "catch_up":
		return CatchUp, nil
	case "skip":
		return Skip, nil
	}
	return 0, fmt.Errorf("missed-ticks policy %q: want catch-up or skip", s)
}

// Defaults.
const (
	DefaultMaxCatchUp        = 1
	DefaultFileCheckInterval = 2 * time.Second
	// DefaultPoll is Config.Poll's default.
	DefaultPoll = 2 * time.Second
)

// Clock tells a scheduler the time and wakes it. Tests inject one that they
// move by hand.
type Clock interface {
	Now() time.Time
	// At returns a channel that receives once the clock reaches t; at once
	// when t has passed. An absolute time, not a duration, so that a clock
	// moved between Now and At cannot make the scheduler oversleep.
	At(t time.Time) <-chan time.Time
}

type realClock struct{}

func (realClock) Now() time.Time                  { return time.Now() }
func (realClock) At(t time.Time) <-chan time.Time { return time.After(time.Until(t)) }

// Config configures a Scheduler.
type Config struct {
	// Client enqueues every tick through the ledger; its pool also holds the
	// keel_schedule table (migration 0003). Required.
	Client *tasks.Client
	// Entries to run. Give Entries or File, not both.
	Entries []Entry
	// File is a YAML schedule (format in the package doc) to take the entries
	// from. The scheduler re-reads it when its modification time or size
	// change, and on Reload; a file that does not load is logged and the
	// running entries stay.
	File string
	// FileCheckInterval is how often File is checked for changes, on real
	// time whatever the Clock. Default DefaultFileCheckInterval (2s).
	FileCheckInterval time.Duration
	// MissedTicks is the policy for missed ticks. Default CatchUp.
	MissedTicks MissedTicks
	// MaxCatchUp is how many missed ticks per entry CatchUp enqueues at most.
	// Default DefaultMaxCatchUp (1); for none, use Skip.
	MaxCatchUp int
	// Kinds are the program's kinds: an entry of one of them takes the
	// kind's defaults (queue, retries, timeout), as tasks the program's own
	// code makes do. Default none.
	Kinds *tasks.Kinds
	// KnownKind reports whether a kind can be run; an entry naming another
	// kind is refused at start and on reload. Default Kinds.Known;
	// AnyKind turns the check off.
	KnownKind func(kind string) bool
	// CheckEntry checks what an entry's ticks would enqueue, at start and
	// on reload, so that an entry every tick would fail with is refused
	// like a bad spec instead of being logged at every tick. The Client's
	// own checks (the queue, the retry budget) always run; the CLI adds
	// that the payload decodes into the kind's type. Optional.
	CheckEntry func(Entry) error
	// Poll is how often the scheduler reads the ledger's run-time entries
	// (inspect.AddSchedule, keel schedule add) and paused entries, so that a
	// change made anywhere reaches every running scheduler within it.
	// Measured on the system clock, whatever Clock is. Default 2s.
	Poll time.Duration
	// Clock is the time source. Default the system clock.
	Clock Clock
	// Logger. Default slog.Default().
	Logger *slog.Logger
}

// WithDefaults returns c with unset fields set to their defaults.
func (c Config) WithDefaults() Config {
	if c.FileCheckInterval == 0 {
		c.FileCheckInterval = DefaultFileCheckInterval
	}
	if c.MaxCatchUp == 0 {
		c.MaxCatchUp = DefaultMaxCatchUp
	}
	if c.Poll == 0 {
		c.Poll = DefaultPoll
	}
	if c.KnownKind == nil {
		c.KnownKind = c.Kinds.Known
	}
	if c.Clock == nil {
		c.Clock = realClock{}
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

// Validate reports the first problem with c, entries included (see
// ValidateEntries). A File is read by New, not here.
func (c Config) Validate() error {
	if c.Client == nil {
		return errors.New("keel: scheduler.Config.Client is required")
	}
	if c.File != "" && len(c.Entries) > 0 {
		return errors.New("keel: scheduler.Config: give Entries or File, not both")
	}
	if c.MissedTicks != CatchUp && c.MissedTicks != Skip {
		return fmt.Errorf("keel: scheduler.Config.MissedTicks: unknown policy %d", int(c.MissedTicks))
	}
	if c.MaxCatchUp < 0 {
		return fmt.Errorf("keel: scheduler.Config.MaxCatchUp %d is negative (for none, use Skip)", c.MaxCatchUp)
	}
	if c.Poll < 0 {
		return fmt.Errorf("keel: scheduler.Config.Poll %s is negative", c.Poll)
	}
	if c.FileCheckInterval < 0 {
		return fmt.Errorf("keel: scheduler.Config.FileCheckInterval %s is negative", c.FileCheckInterval)
	}
	known := c.KnownKind
	if known == nil {
		known = c.Kinds.Known
	}
	return ValidateEntries(c.Entries, known)
}
