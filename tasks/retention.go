package tasks

import (
	"fmt"
	"time"

	"github.com/keeljobs/keel/inspect"
	"github.com/keeljobs/keel/internal/ledger"
)

// keepOption is a retention policy a kind declares; only Define takes it.
type keepOption struct{ p inspect.RetentionPolicy }

func (keepOption) apply(*settings) {}
func (o keepOption) kindOnly() string {
	return fmt.Sprintf("tasks.Keep(%q)", o.p.Status)
}

// Keep sets how long the kind's jobs of status ("succeeded", "discarded",
// "cancelled" or "dead") are kept after they finished, instead of the
// worker's retention (server's ReconcilerConfig.Retention, 30 days by
// default; dead letters: for ever). d is at least inspect.MinRetention (an
// hour), or 0 for ever. For a dead letter it is an age past which the
// letter goes once a person has seen it and a notice has run; see
// KeepDeadAtMost. The kind's workers record it in the ledger when they
// start; a person's policy (keel retention set) is in force over it.
//
// Keeping succeeded jobs is keeping their keys' dedupe: once a job is
// pruned, its key makes a new job. Define refuses a Keep shorter than the
// kind's Unique window, which it would cut short.
func Keep(status string, d time.Duration) Option {
	return keepOption{inspect.RetentionPolicy{Status: status, Keep: d}}
}

// KeepDeadAtMost bounds the kind's dead letters to n: beyond it the oldest
// ones a person has seen go, a notice after an alert says so; unseen ones
// are never dropped (they count toward n all the same).
func KeepDeadAtMost(n int64) Option {
	return keepOption{inspect.RetentionPolicy{Status: "dead", MaxCount: n}}
}

// add records o on the kind, merging a dead letter's age and count
// into one policy; it panics on what cannot work, as Define does.
func (ks keepSet) add(name string, unique time.Duration, o keepOption) keepSet {
	p := o.p
	p.Kind, p.Source = name, inspect.SourceCode
	for i := range ks {
		if ks[i].Status == p.Status {
			if p.Keep == 0 {
				p.Keep = ks[i].Keep
			}
			if p.MaxCount == 0 {
				p.MaxCount = ks[i].MaxCount
			}
			ks = append(ks[:i], ks[i+1:]...)
			break
		}
	}
	if err := ledger.ValidatePolicy(p); err != nil {
		panic(fmt.Sprintf("keel: kind %q: %v", name, err))
	}
	if p.Status != "dead" && p.Keep > 0 && unique > p.Keep {
		panic(fmt.Sprintf("keel: kind %q: tasks.Keep(%q, %s) is shorter than its tasks.Unique window %s, which it would cut short",
			name, p.Status, p.Keep, unique))
	}
	return append(ks, p)
}

// keepSet is a kind's declared retention policies, one per status.
type keepSet []inspect.RetentionPolicy

// Retention returns the retention policies the kind declares (Keep,
// KeepDeadAtMost), one per status.
func (k *Kind[P]) Retention() []inspect.RetentionPolicy {
	return append([]inspect.RetentionPolicy(nil), k.keep...)
}

// Retention returns the retention policies kind declares in code (Keep,
// KeepDeadAtMost); none when the set does not hold it.
func (ks *Kinds) Retention(kind string) []inspect.RetentionPolicy {
	if k, ok := ks.lookup(kind); ok {
		return k.Retention()
	}
	return nil
}
