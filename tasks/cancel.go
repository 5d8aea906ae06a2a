package tasks

import (
	"context"

	"github.com/keeljobs/keel/inspect"
)

// DefaultCancelActor is who a cancel made through a Client is recorded as
// when CancelBy is not given.
const DefaultCancelActor = "api"

// CancelOption says who cancels a job and why; both go to the audit log.
type CancelOption interface{ applyCancel(*cancelConfig) }

type cancelOptionFunc func(*cancelConfig)

func (f cancelOptionFunc) applyCancel(c *cancelConfig) { f(c) }

type cancelConfig struct{ actor, note string }

// CancelBy names who cancels (a user, a service). Default DefaultCancelActor.
func CancelBy(actor string) CancelOption {
	return cancelOptionFunc(func(c *cancelConfig) { c.actor = actor })
}

// CancelNote says why the job is cancelled.
func CancelNote(note string) CancelOption {
	return cancelOptionFunc(func(c *cancelConfig) { c.note = note })
}

// Cancel closes the job id for good (Inspector().Cancel, with the actor
// and note the options give) if it has not finished: a job waiting
// (pending, scheduled, failed and waiting for its retry) never runs, and a
// running job's handler context is cancelled; nothing that run does later
// commits (its InTx and Step return idempotency.ErrCancelled). Effects that
// already happened are not undone: a step whose call had left when the
// cancel came stays in doubt.
//
// Cancelling a cancelled job is a no-op (AlreadyCancelled). A job that has
// ended (succeeded, dead, discarded) is refused with
// inspect.ErrNotCancellable; an unknown id with inspect.ErrNotFound.
// The job's (kind, business key) stays taken: enqueueing it again returns
// the cancelled job.
func (c *Client) Cancel(ctx context.Context, id string, opts ...CancelOption) (inspect.CancelResult, error) {
	cfg := cancelOptions(opts)
	return c.ops.Cancel(ctx, id, cfg.actor, cfg.note)
}

// CancelByKey cancels the job of kind with business key; see Cancel.
func (c *Client) CancelByKey(ctx context.Context, kind, key string, opts ...CancelOption) (inspect.CancelResult, error) {
	cfg := cancelOptions(opts)
	return c.ops.CancelByKey(ctx, kind, key, cfg.actor, cfg.note)
}

func cancelOptions(opts []CancelOption) cancelConfig {
	cfg := cancelConfig{actor: DefaultCancelActor}
	for _, o := range opts {
		o.applyCancel(&cfg)
	}
	return cfg
}
