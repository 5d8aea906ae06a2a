package scheduler

import (
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/keeljobs/keel/internal/ledger"
)

// fromLedger is the Entry of a run-time entry as the ledger holds it.
func fromLedger(e ledger.ScheduleEntry) Entry {
	return Entry{Name: e.Name, Spec: e.Spec, TimeZone: e.TimeZone, Kind: e.Kind, Payload: json.RawMessage(e.Payload),
		Queue: e.Queue, MaxRetry: e.MaxRetry, Timeout: time.Duration(e.TimeoutMS) * time.Millisecond}
}

// Refresh reads the ledger's run-time entries and paused entries now, as
// the scheduler does every Config.Poll, and runs what changed. A run-time
// entry this scheduler cannot run (its kind unknown here, a name its own
// entries take) is logged and left out; the others run.
func (s *Scheduler) Refresh(ctx context.Context) error {
	s.pollMu.Lock()
	defer s.pollMu.Unlock()
	err := s.refresh(ctx)
	switch {
	case err != nil && ctx.Err() == nil && err.Error() != s.pollErr:
		// Once per distinct failure, not at every poll.
		s.mu.Lock()
		read := s.pausesRead
		s.mu.Unlock()
		what := "the running entries stay"
		if !read {
			what = "no entry fires until the pauses have been read once (any may be paused)"
		}
		s.log.Error("keel scheduler: cannot read the run-time entries and pauses from the ledger, or record its entries there; "+what,
			"err", err, "poll", s.cfg.Poll.String())
		s.pollErr = err.Error()
	case err == nil && s.pollErr != "":
		s.log.Info("keel scheduler: the ledger's run-time entries and pauses are read again")
		s.pollErr = ""
	}
	s.signals.Polled.Signal(err)
	return err
}

func (s *Scheduler) refresh(ctx context.Context) error {
	rows, pauses, err := s.store.runtime(ctx)
	if err != nil {
		return err
	}
	s.mu.Lock()
	config := s.config
	s.mu.Unlock()
	var cs []compiled
	rejected := map[string]bool{}
	for _, row := range rows {
		c, err := s.check(fromLedger(row))
		if err == nil && slices.ContainsFunc(config, func(o compiled) bool { return o.Name == row.Name }) {
			err = fmt.Errorf("schedule entry %q: this scheduler's file or code has an entry of that name, which runs instead", row.Name)
		}
		if err != nil {
			if !s.rejected[row.Name] {
				s.log.Error("keel scheduler: run-time entry not run by this scheduler", "entry", row.Name, "err", err)
			}
			rejected[row.Name] = true
			continue
		}
		cs = append(cs, c)
	}
	s.rejected = rejected
	paused := make(map[string]bool, len(pauses))
	for _, p := range pauses {
		paused[p.Entry] = true
	}
	s.mu.Lock()
	changed := !slices.EqualFunc(s.ledger, cs, func(a, b compiled) bool { return equalEntry(a.Entry, b.Entry) }) ||
		!maps.Equal(s.paused, paused) || !s.pausesRead
	if changed {
		s.ledger, s.paused, s.pausesRead = cs, paused, true
		s.merge()
	}
	entries := s.entries
	s.mu.Unlock()
	if changed {
		s.wake()
	}
	return s.store.describe(ctx, entries, s.cfg.Clock.Now())
}

// check compiles e as setEntries does, with the client's checks.
func (s *Scheduler) check(e Entry) (compiled, error) {
	c, err := compile(e, s.cfg.KnownKind)
	if err != nil {
		return compiled{}, err
	}
	err = s.cfg.Client.Check(c.task(s.cfg.Kinds, TickKey(c.Name, time.Time{})))
	if err == nil && s.cfg.CheckEntry != nil {
		err = s.cfg.CheckEntry(c.Entry)
	}
	if err != nil {
		return compiled{}, &EntryError{Name: c.Name, Field: "task", Err: err}
	}
	return c, nil
}

// pollLedger calls Refresh every Config.Poll until ctx is done.
func (s *Scheduler) pollLedger(ctx context.Context) {
	t := time.NewTicker(s.cfg.Poll)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		_ = s.Refresh(ctx) // logs its failure
	}
}
