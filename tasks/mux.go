package tasks

import (
	"context"
	"fmt"
	"sort"
	"sync"

	"github.com/hibiken/asynq"

	"github.com/keeljobs/keel/retry"
)

// Mux routes jobs to handlers by kind.
type Mux struct {
	mu       sync.RWMutex
	handlers map[string]asynq.Handler
	declared []AnyKind // the kinds given to Handle, with their Summary
}

// NewMux returns an empty mux.
func NewMux() *Mux { return &Mux{handlers: map[string]asynq.Handler{}} }

// Handle registers fn for kind k:
//
//	tasks.Handle(mux, SendReceipt, func(ctx context.Context, r Receipt) error { … })
func Handle[P any](m *Mux, k *Kind[P], fn func(ctx context.Context, p P) error) {
	m.HandleTask(k.Name(), k.Handler(fn))
	m.mu.Lock()
	m.declared = append(m.declared, k)
	m.mu.Unlock()
}

// Declared is the set of kinds given to Handle: a worker applies their
// Summary to its dead letters without being told them a second time.
func (m *Mux) Declared() *Kinds {
	m.mu.RLock()
	defer m.mu.RUnlock()
	return NewKinds(m.declared...)
}

// HandleTask registers an untyped handler for a kind name.
func (m *Mux) HandleTask(kind string, h asynq.Handler) {
	if kind == "" || h == nil {
		panic("keel: Mux.HandleTask needs a kind and a handler")
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if _, dup := m.handlers[kind]; dup {
		panic(fmt.Sprintf("keel: kind %q registered twice", kind))
	}
	m.handlers[kind] = h
}

// Kinds lists the registered kinds.
func (m *Mux) Kinds() []string {
	m.mu.RLock()
	defer m.mu.RUnlock()
	ks := make([]string, 0, len(m.handlers))
	for k := range m.handlers {
		ks = append(ks, k)
	}
	sort.Strings(ks)
	return ks
}

// ErrNoHandler is returned for a job whose kind this worker does not know.
var ErrNoHandler = fmt.Errorf("no handler for this kind on this worker")

// ProcessTask implements asynq.Handler. A kind with no handler is a
// transient failure, not a permanent one: during a rolling deploy a newer
// worker may know it. It is retried with backoff within the job's budget and
// then lands in the dead letters, where it can be replayed — never lost, never
// retried forever.
func (m *Mux) ProcessTask(ctx context.Context, t *asynq.Task) error {
	m.mu.RLock()
	h, ok := m.handlers[t.Type()]
	m.mu.RUnlock()
	if !ok {
		return retry.Transient(fmt.Errorf("keel: kind %q: %w", t.Type(), ErrNoHandler))
	}
	return h.ProcessTask(ctx, t)
}
