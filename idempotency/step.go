package idempotency

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/keeljobs/keel/retry"
)

// StepOption configures one recorded step.
type StepOption func(*stepConfig)

type stepConfig struct {
	verify func(ctx context.Context, key string) (done bool, err error)
}

// Verify gives a step a way to find out, after a crash, whether its call
// happened (for example by asking the external API about the idempotency
// key). done = true records the step as finished without calling it again;
// done = false makes the step safe to call once more.
func Verify(fn func(ctx context.Context, key string) (done bool, err error)) StepOption {
	return func(c *stepConfig) { c.verify = fn }
}

// StepKey is the stable idempotency key of a step: the same for every
// attempt of the job, different for every step.
func StepKey(jobID, name string) string { return jobID + ":" + name }

// Step runs an external side effect at most once per job. fn receives a
// stable idempotency key to pass to the external API.
//
//   - A step that finished in an earlier attempt is skipped.
//   - fn returning an error means the call did not take effect; the step may
//     run again on the next attempt (with the same key).
//   - A step that started but never recorded an outcome (the process died
//     mid-call) is in doubt: its Verify function decides, and without one the
//     job goes to the dead letters with ErrInDoubt — never a blind repeat.
func Step(ctx context.Context, name string, fn func(ctx context.Context, key string) error, opts ...StepOption) error {
	_, err := StepValue(ctx, name, func(ctx context.Context, key string) (struct{}, error) {
		return struct{}{}, fn(ctx, key)
	}, opts...)
	return err
}

// StepValue is Step for a call with a small result (an external id, a
// receipt number). The result is stored as JSON and returned again, without
// calling fn, on later attempts. A step finished by Verify has no stored
// result and returns T's zero value.
func StepValue[T any](ctx context.Context, name string, fn func(ctx context.Context, key string) (T, error), opts ...StepOption) (T, error) {
	var zero T
	jc, err := jobFrom(ctx)
	if err != nil {
		return zero, err
	}
	if err := ValidateKey("step name", name); err != nil {
		return zero, retry.Permanent(fmt.Errorf("keel: %w", err))
	}
	var cfg stepConfig
	for _, o := range opts {
		o(&cfg)
	}
	g := jc.guard
	pool := g.store.pool
	key := StepKey(jc.id, name)

	// "started" commits on its own before the call: if the process dies
	// during the call, the next attempt knows the call may have happened.
	var leased, fresh bool
	err = pool.QueryRow(ctx, `WITH lease AS (
			SELECT 1 FROM keel_jobs WHERE id = $1 AND status = 'running' AND lease_holder = $3),
		ins AS (
			INSERT INTO keel_steps (job_id, name, status) SELECT $1, $2, 'started' FROM lease
			ON CONFLICT (job_id, name) DO NOTHING RETURNING 1)
		SELECT EXISTS (SELECT 1 FROM lease), EXISTS (SELECT 1 FROM ins)`, jc.id, name, g.cfg.Holder).Scan(&leased, &fresh)
	if err != nil {
		return zero, interpretError(err)
	}
	if !leased {
		return zero, ErrLeaseLost
	}
	if !fresh {
		var status string
		var result []byte
		err := pool.QueryRow(ctx, `SELECT status, result FROM keel_steps WHERE job_id = $1 AND name = $2`, jc.id, name).Scan(&status, &result)
		if err != nil {
			return zero, interpretError(err)
		}
		if status == "done" {
			var v T
			if len(result) > 0 {
				if err := json.Unmarshal(result, &v); err != nil {
					return zero, retry.Permanent(fmt.Errorf("keel: step %q: stored result does not decode: %w", name, err))
				}
			}
			return v, nil
		}
		// Started and never finished: the call may or may not have happened.
		if cfg.verify == nil {
			return zero, retry.Permanent(fmt.Errorf("keel: step %q of job %s: %w", name, jc.id, ErrInDoubt))
		}
		done, err := cfg.verify(ctx, key)
		if err != nil {
			return zero, fmt.Errorf("keel: verifying step %q: %w", name, err)
		}
		if done {
			if _, err := pool.Exec(ctx, `UPDATE keel_steps SET status = 'done', finished_at = now()
				WHERE job_id = $1 AND name = $2`, jc.id, name); err != nil {
				return zero, interpretError(err)
			}
			return zero, nil
		}
		if _, err := pool.Exec(ctx, `UPDATE keel_steps SET calls = calls + 1, started_at = now()
			WHERE job_id = $1 AND name = $2`, jc.id, name); err != nil {
			return zero, interpretError(err)
		}
	}

	v, ferr := fn(ctx, key)
	bg := context.WithoutCancel(ctx)
	if ferr != nil {
		if errors.Is(ferr, ErrInDoubt) {
			// fn cannot tell whether its call took effect: keep "started" so
			// the next attempt goes through Verify or to a person.
			return zero, ferr
		}
		// fn says the call did not take effect: forget the start so the next
		// attempt calls again, with the same key.
		if _, err := pool.Exec(bg, `DELETE FROM keel_steps WHERE job_id = $1 AND name = $2 AND status = 'started'`, jc.id, name); err != nil {
			return zero, errors.Join(ferr, interpretError(err))
		}
		return zero, ferr
	}
	result, err := json.Marshal(v)
	if err != nil {
		return zero, retry.Permanent(fmt.Errorf("keel: step %q result does not encode: %w", name, err))
	}
	tag, err := pool.Exec(bg, `UPDATE keel_steps SET status = 'done', result = $3, finished_at = now()
		WHERE job_id = $1 AND name = $2 AND status = 'started'`, jc.id, name, result)
	if err != nil {
		// The call happened but we could not say so: the next attempt finds
		// the step in doubt and verifies it.
		return zero, fmt.Errorf("keel: step %q done but not recorded: %w", name, interpretError(err))
	}
	if tag.RowsAffected() == 0 {
		// Someone removed the step's record while the call ran: whether it
		// counts is for a person, not for a silent second call.
		return zero, retry.Permanent(fmt.Errorf("keel: step %q of job %s lost its record during the call: %w", name, jc.id, ErrInDoubt))
	}
	return v, nil
}

// InDoubt marks an error from a step's fn as "the call may have happened"
// (a timeout after sending, say): the step stays open for Verify or a person
// instead of being called again.
func InDoubt(err error) error { return fmt.Errorf("%w: %w", ErrInDoubt, err) }
