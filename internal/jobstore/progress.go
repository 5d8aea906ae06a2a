package jobstore

import (
	"context"
	"errors"
	"fmt"
	"unicode/utf8"

	"github.com/keeljobs/keel/internal/ledger"
)

// ErrNoResult means the job has no result: it has not succeeded (yet), or
// its handler stored none.
var ErrNoResult = errors.New("keel: the job has no result")

// Progress returns job id's progress as its handler last reported it;
// ok false when it reported none. It does not say whether the job exists.
func (s *Store) Progress(ctx context.Context, id string) (p ledger.JobProgress, ok bool, err error) {
	if !utf8.ValidString(id) || id == "" {
		return p, false, nil
	}
	p, err = ledger.ReadProgress(ctx, s.pool, id)
	if err = Interpret(err); errors.Is(err, ErrNotFound) {
		return p, false, nil
	}
	return p, err == nil, err
}

// Result returns job id's result: ErrNotFound without such a job,
// ErrNoResult (naming its status) when it has none.
func (s *Store) Result(ctx context.Context, id string) (ledger.JobResult, error) {
	if !utf8.ValidString(id) || id == "" {
		return ledger.JobResult{}, ErrNotFound
	}
	return hasResult(ledger.ReadResult(ctx, s.pool, id))
}

// ResultByKey is Result for the job of kind with business key.
func (s *Store) ResultByKey(ctx context.Context, kind, businessKey string) (ledger.JobResult, error) {
	if ledger.ValidateKey("kind", kind) != nil || ledger.ValidateKey("business key", businessKey) != nil {
		return ledger.JobResult{}, ErrNotFound
	}
	return hasResult(ledger.ReadResultByKey(ctx, s.pool, kind, businessKey))
}

func hasResult(r ledger.JobResult, err error) (ledger.JobResult, error) {
	if err != nil {
		return r, Interpret(err)
	}
	switch {
	case r.JSON != nil:
		return r, nil
	case r.Status == ledger.StatusSucceeded:
		return r, fmt.Errorf("%w: job %s succeeded without storing one", ErrNoResult, r.JobID)
	case r.Status.Terminal():
		return r, fmt.Errorf("%w: job %s is %s and will not succeed", ErrNoResult, r.JobID, r.Status)
	}
	return r, fmt.Errorf("%w: job %s is %s; a result is stored only with its success", ErrNoResult, r.JobID, r.Status)
}
