package tasks_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/keeljobs/keel/internal/ledger"
	"github.com/keeljobs/keel/server"
	"github.com/keeljobs/keel/tasks"
)

// A queue name a worker refuses must be refused where kinds are declared and
// where jobs are enqueued, or its jobs would wait forever on a queue no
// worker can read: the same rule everywhere.
func TestQueueNamesFollowTheWorkersRule(t *testing.T) {
	b := setup(t)
	bad := []string{`q"><img src=x onerror=alert(1)>`, `q"><img`, "has space", "a:b", "a,b", "{tag}", "tab\tq", "",
		"ü-nicode", string(make([]byte, 101))}
	for _, q := range bad {
		require.Error(t, ledger.ValidateQueue(q), "%q", q)
		worker := server.Config{Redis: b.redis, Pool: b.pool, Concurrency: 1, Queues: map[string]int{q: 1}}
		require.ErrorContains(t, worker.Validate(), "queue", "the worker refuses %q", q)
		c, err := tasks.NewClient(tasks.ClientConfig{Redis: b.redis, Pool: b.pool, Queues: []string{q}})
		require.ErrorContains(t, err, "queue", "a client refuses %q", q)
		require.Nil(t, c)
		if q == "" {
			continue // tasks.Queue("") means the default queue
		}
		msg := panicMessage(func() {
			tasks.Define[receipt]("test:bad_queue", tasks.Key(func(r receipt) string { return r.OrderID }), tasks.Queue(q))
		})
		require.Contains(t, msg, "queue", "Define refuses %q", q)
		_, err = b.client.Enqueue(t.Context(), tasks.NewRaw("test:raw", []byte(`{}`), "k", tasks.Queue(q)))
		require.ErrorIs(t, err, tasks.ErrUnknownQueue, "enqueue refuses %q", q)
	}
	for _, q := range []string{"critical", "emails-eu.west_2", "Q1"} {
		require.NoError(t, ledger.ValidateQueue(q))
		worker := server.Config{Redis: b.redis, Pool: b.pool, Concurrency: 1, Queues: map[string]int{q: 1}}
		require.NoError(t, worker.Validate())
	}
}
