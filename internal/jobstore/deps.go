package jobstore

import (
	"context"
	"errors"
	"fmt"

	"github.com/google/uuid"

	"github.com/keeljobs/keel/internal/ledger"
)

var (
	// ErrUnknownParent means a job was to wait for a job that does not
	// exist.
	ErrUnknownParent = errors.New("keel: unknown parent job")
	// ErrParentEnded means a job was to wait for a job that was cancelled
	// or discarded: it would never succeed, so the new job would never run.
	ErrParentEnded = errors.New("keel: parent job was cancelled or discarded")
)

// Ref names a job another waits for: by id, or by kind and business key.
type Ref struct {
	ID, Kind, Key string
}

func (r Ref) String() string {
	if r.ID != "" {
		return r.ID
	}
	return r.Kind + "/" + r.Key
}

// validate checks what a ref can name before a statement is sent.
func (r Ref) validate() error {
	if r.ID != "" {
		if r.Kind != "" || r.Key != "" {
			return fmt.Errorf("a parent is named by id or by kind and key, not both")
		}
		if _, err := uuid.Parse(r.ID); err != nil {
			return fmt.Errorf("%w: %q is not a job id", ErrUnknownParent, r.ID)
		}
		return nil
	}
	if err := ledger.ValidateKey("parent kind", r.Kind); err != nil {
		return err
	}
	return ledger.ValidateKey("parent business key", r.Key)
}

// lockParents locks and marks the parents of nj (nj.After) in tx, checks
// them, and returns what the job's insert writes besides its row: a row
// per parent, waiting for those that have not succeeded.
func lockParents(ctx context.Context, tx DB, nj NewJob) (ledger.Waiting, error) {
	w := ledger.Waiting{WorkflowID: nj.WorkflowID, Task: nj.WorkflowTask}
	var ids, kinds, keys []string
	for _, r := range nj.After {
		if err := r.validate(); err != nil {
			return w, fmt.Errorf("keel: %w", err)
		}
		if r.ID != "" {
			ids = append(ids, r.ID)
		} else {
			kinds, keys = append(kinds, r.Kind), append(keys, r.Key)
		}
	}
	found, err := ledger.LockParents(ctx, tx, ids, kinds, keys)
	if err != nil {
		return w, Interpret(err)
	}
	byID := make(map[string]ledger.Parent, len(found))
	byKey := make(map[[2]string]ledger.Parent, len(found))
	for _, p := range found {
		byID[p.ID] = p
		byKey[[2]string{p.Kind, p.BusinessKey}] = p
	}
	seen := map[string]bool{}
	for _, r := range nj.After {
		p, ok := byID[r.ID]
		if r.ID == "" {
			p, ok = byKey[[2]string{r.Kind, r.Key}]
		}
		if !ok {
			return w, fmt.Errorf("%w: %s", ErrUnknownParent, r)
		}
		if p.Status == ledger.StatusCancelled || p.Status == ledger.StatusDiscarded {
			return w, fmt.Errorf("%w: %s (%s/%s) is %s", ErrParentEnded, p.ID, p.Kind, p.BusinessKey, p.Status)
		}
		if seen[p.ID] {
			continue
		}
		seen[p.ID] = true
		w.Parents = append(w.Parents, p.ID)
		// A parent dead with its effects in met its children's dependency
		// when it succeeded; one enqueued after it does not wait for it.
		if p.Status == ledger.StatusSucceeded || p.EffectsIn {
			w.Met = append(w.Met, p.ID)
		} else {
			w.WaitingOn++
		}
	}
	return w, nil
}

// waitingJob is j, just written with w (nil: written without parents).
func waitingJob(j Job, w *ledger.Waiting) Job {
	if w == nil {
		return j
	}
	j.WaitingOn, j.WorkflowID, j.WorkflowTask = w.WaitingOn, w.WorkflowID, w.Task
	if w.WaitingOn > 0 {
		j.Status = ledger.StatusWaiting
	}
	return j
}
