package testenv

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/hibiken/asynq"
)

// WaitAsynqIdle waits until asynq holds no task of queues that could still
// be delivered (pending, active, scheduled, retry, aggregating): from then
// on no handler can start unless something publishes again. A test checks
// "nothing more ran" after it, instead of after a sleep.
func WaitAsynqIdle(t testing.TB, opt asynq.RedisConnOpt, timeout time.Duration, queues ...string) {
	t.Helper()
	insp := asynq.NewInspector(opt)
	defer insp.Close()
	idle := func() error {
		known, err := insp.Queues()
		if err != nil {
			return err
		}
		for _, q := range queues {
			if !slices.Contains(known, q) {
				continue // never used: it holds nothing
			}
			info, err := insp.GetQueueInfo(q)
			if err != nil {
				return err
			}
			if n := info.Pending + info.Active + info.Scheduled + info.Retry + info.Aggregating; n > 0 {
				return fmt.Errorf("queue %s holds %d", q, n)
			}
		}
		return nil
	}
	deadline := time.Now().Add(timeout)
	for {
		err := idle()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("testenv: asynq never let go of its tasks within %s: %v", timeout, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
