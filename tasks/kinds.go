package tasks

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"unicode/utf16"
	"unicode/utf8"

	"github.com/keeljobs/keel/inspect"
)

// AnyKind is a declared kind of any payload type (a *Kind[P]), as NewKinds
// takes it.
type AnyKind interface {
	Name() string
	Queue() string
	info() kindInfo
}

// kindInfo is what a set of kinds needs of a kind without its payload type.
type kindInfo interface {
	AnyKind
	summarize(payload []byte) (string, bool)
	defaultSettings() settings
	Retention() []inspect.RetentionPolicy
	newJSON(payload []byte, opts []Option) (*Task, error)
	rawConcurrency(t *Task)
}

// Kinds is the set of kinds a program declares, built once with NewKinds
// and given to what needs more than a kind's name: the worker (dead jobs'
// payload summaries), the dashboard (which payloads it may show), the
// scheduler and the CLI (which kinds exist, and their defaults). A program
// says which kinds are its own; what it happens to import does not.
//
// A Kinds does not change once built, so one may be shared freely. A nil
// *Kinds is the empty set.
type Kinds struct {
	byName map[string]kindInfo
}

// NewKinds returns the set of kinds ks. It panics when two differ but
// share a name, a mistake that must stop the program at start.
func NewKinds(ks ...AnyKind) *Kinds {
	set, err := (*Kinds)(nil).With(ks...)
	if err != nil {
		panic("keel: tasks.NewKinds: " + err.Error())
	}
	return set
}

// With returns a new set of the kinds of ks and more (ks may be nil); an
// error when two of them differ but share a name.
func (ks *Kinds) With(more ...AnyKind) (*Kinds, error) {
	all := append(ks.All(), more...)
	set := &Kinds{byName: make(map[string]kindInfo, len(all))}
	for _, k := range all {
		if old, ok := set.byName[k.Name()]; ok && old != k.info() {
			return nil, fmt.Errorf("two kinds are named %q", k.Name())
		}
		set.byName[k.Name()] = k.info()
	}
	return set, nil
}

// Known reports whether the set holds a kind of this name.
func (ks *Kinds) Known(name string) bool {
	_, ok := ks.lookup(name)
	return ok
}

// All returns the set's kinds, by name.
func (ks *Kinds) All() []AnyKind {
	var all []AnyKind
	if ks != nil {
		for _, k := range ks.byName {
			all = append(all, k)
		}
	}
	slices.SortFunc(all, func(a, b AnyKind) int { return strings.Compare(a.Name(), b.Name()) })
	return all
}

func (ks *Kinds) lookup(name string) (kindInfo, bool) {
	if ks == nil {
		return nil, false
	}
	k, ok := ks.byName[name]
	return k, ok
}

// Summarize returns the payload summary kept with a dead job: the kind's
// Summary function when the set holds the kind and it has one, otherwise
// the start of the payload. A Summary that panics (the application's bug,
// often on the very payload that fails) gives a note saying so instead of
// the payload it was there to redact: the dead letter is still recorded,
// and asynqmon's queue pages, which show every task through it, still load.
func (ks *Kinds) Summarize(kind string, payload []byte) (summary string) {
	if k, ok := ks.lookup(kind); ok {
		defer func() {
			if p := recover(); p != nil {
				summary = fmt.Sprintf("(no summary: the kind's Summary panicked: %v)", p)
			}
		}()
		if s, ok := k.summarize(payload); ok {
			return s
		}
	}
	const max = 512
	if len(payload) > max {
		payload = payload[:max]
	}
	return string([]rune(string(payload)))
}

// NewRaw makes a task from an already-encoded JSON payload, for tools (the
// CLI, the scheduler's config file) that do not know the Go payload type. A
// kind of the set gives the task its defaults (queue, retries, timeout), so
// a cron entry behaves like Go code; opts override them. Like New it
// refuses Key and Summary, when the task is enqueued.
func (ks *Kinds) NewRaw(kind string, payload []byte, key string, opts ...Option) *Task {
	t := &Task{kind: kind, payload: payload}
	k, declared := ks.lookup(kind)
	if declared {
		t.s = k.defaultSettings()
		t.s.queue = k.Queue()
		t.kindQueue = t.s.queue
	}
	t.err = applyTaskOptions(&t.s, opts)
	if declared && t.err == nil {
		// The kind's handler decodes it as JSON, which would change it.
		if err := checkJSONText(payload); err != nil {
			t.err = fmt.Errorf("%w: %s: %v", ErrInvalidTask, kind, err)
		} else {
			k.rawConcurrency(t)
		}
	}
	if key != "" {
		t.s.key = key
	}
	if t.s.queue == "" {
		t.s.queue = DefaultQueue
	}
	return t
}

// NewJSON makes a task of a kind of the set from a JSON payload typed by a
// person (the CLI's enqueue, a schedule file): it must decode into the
// kind's payload type with no field the type lacks, and the task is what
// the kind's New makes of it, business key included (BusinessKey in opts
// overrides it). Text decoding would change (not UTF-8, an escaped lone
// surrogate) is refused with ErrInvalidTask, as NewRaw's for a kind of the
// set is when the task is enqueued.
func (ks *Kinds) NewJSON(kind string, payload []byte, opts ...Option) (*Task, error) {
	k, ok := ks.lookup(kind)
	if !ok {
		return nil, fmt.Errorf("keel: kind %q is not one of the set's", kind)
	}
	return k.newJSON(payload, opts)
}

func (k *Kind[P]) info() kindInfo { return k }

func (k *Kind[P]) defaultSettings() settings { return k.defaults }

func (k *Kind[P]) summarize(payload []byte) (string, bool) {
	if k.summary == nil {
		return "", false
	}
	var p P
	if err := json.Unmarshal(payload, &p); err != nil {
		return "(payload does not decode)", true
	}
	return k.summary(p), true
}

// rawConcurrency gives a raw task of the kind its concurrency key, from
// its payload decoded: one that does not decode cannot be keyed, and is
// refused rather than let through unlimited.
func (k *Kind[P]) rawConcurrency(t *Task) {
	if k.ckey == nil {
		return
	}
	var p P
	if err := json.Unmarshal(t.payload, &p); err != nil {
		t.err = fmt.Errorf("%w: %s: payload does not decode for its concurrency key: %v", ErrInvalidTask, k.name, err)
		return
	}
	k.concurrency(t, p)
}

func (k *Kind[P]) newJSON(payload []byte, opts []Option) (*Task, error) {
	if err := checkJSONText(payload); err != nil {
		return nil, fmt.Errorf("%w: %s: %v", ErrInvalidTask, k.name, err)
	}
	var p P
	dec := json.NewDecoder(bytes.NewReader(payload))
	dec.DisallowUnknownFields()
	err := dec.Decode(&p)
	if err == nil && dec.More() {
		err = errors.New("more than one JSON value")
	}
	if err != nil {
		return nil, fmt.Errorf("payload does not decode into %s's type %T: %v", k.name, p, err)
	}
	return k.New(p, opts...), nil
}

// checkJSONText refuses JSON text that decoding would change: bytes that are
// not UTF-8 and escaped lone UTF-16 surrogates both decode to U+FFFD, so two
// payloads would give one business key, and two actions one job.
func checkJSONText(payload []byte) error {
	if !utf8.Valid(payload) {
		return errors.New("the payload is not valid UTF-8 (decoded, its bad bytes would become U+FFFD)")
	}
	// A backslash stands only inside strings in valid JSON (what does not
	// decode is refused anyway): no need to track where strings are.
	for i := 0; i < len(payload); i++ {
		if payload[i] != '\\' {
			continue
		}
		i++ // the escaped character: \\ is skipped whole
		r := escapedRune(payload, i)
		if !utf16.IsSurrogate(r) {
			continue
		}
		if lo := escapedRune(payload, i+6); r < 0xdc00 && 0xdc00 <= lo && lo < 0xe000 {
			i += 6 // a high surrogate and its low one: one rune
			continue
		}
		return fmt.Errorf("the payload escapes a lone UTF-16 surrogate (%s), which has no UTF-8 form (decoded, it would become U+FFFD)", payload[i-1:i+5])
	}
	return nil
}

// escapedRune is the code of the \uXXXX escape whose u is at b[i], or -1.
func escapedRune(b []byte, i int) rune {
	if i+5 > len(b) || b[i] != 'u' || (i > 0 && b[i-1] != '\\') {
		return -1
	}
	n, err := strconv.ParseUint(string(b[i+1:i+5]), 16, 16)
	if err != nil {
		return -1
	}
	return rune(n)
}
