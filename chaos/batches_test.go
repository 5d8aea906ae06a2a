package chaos_test

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/internal/jobstore"
	"github.com/keeljobs/keel/tasks"
)

// batchDoneKind is the batches variant's callback. Its name is outside
// "chaos:" so the soak's own accounting of jobs leaves it alone.
var batchDoneKind = tasks.DefineBatchDone("chaosbatch:done", tasks.Queue("critical"))

// recordBatchCallback records a callback's run in its completing
// transaction: a second run of one callback job cannot add a row, a second
// callback job would.
func recordBatchCallback(ctx context.Context, d tasks.BatchDone) error {
	counts, err := json.Marshal(d.Counts)
	if err != nil {
		return err
	}
	return idempotency.InTx(ctx, func(tx pgx.Tx) error {
		id, _ := idempotency.JobID(ctx)
		_, err := tx.Exec(ctx, `INSERT INTO chaos_batch_callbacks (batch_id, event, generation, counts, job_id)
			VALUES ($1, $2, $3, $4, $5)`, d.BatchID, d.Event, d.Generation, counts, id)
		return err
	})
}

// openBatches makes the variant's batches, each with both callbacks, and
// the deadline jobs' batch when there are deadline jobs.
func (d *driver) openBatches(ctx context.Context) {
	open := func(desc string) string {
		b, err := d.client.NewBatch(ctx, tasks.BatchSpec{Description: desc,
			OnComplete: tasks.BatchCallback(batchDoneKind, nil), OnSuccess: tasks.BatchCallback(batchDoneKind, nil)})
		if err != nil {
			d.t.Fatalf("batches: %v", err)
		}
		d.batches = append(d.batches, b.ID)
		return b.ID
	}
	for i := range d.cfg.Batches {
		open(fmt.Sprintf("chaos batch %d", i))
	}
	if d.cfg.Deadlines > 0 {
		d.deadlineBatch = open("chaos deadline jobs")
	}
}

// sealBatches seals every batch once the submissions are done, retrying
// through the faults of the run.
func (d *driver) sealBatches(ctx context.Context) {
	for _, id := range d.batches {
		for {
			_, err := d.client.SealBatch(ctx, id)
			if err == nil {
				break
			}
			d.note(fmt.Sprintf("seal batch %s: %v (retrying)", id, err))
			if pause(ctx, time.Second) != nil {
				return
			}
		}
	}
	if len(d.batches) > 0 {
		d.note(fmt.Sprintf("%d batches sealed", len(d.batches)))
	}
}

// batchesConverge waits until every batch is complete and its callback
// jobs have ended.
func (d *driver) batchesConverge(deadline time.Time) bool {
	if len(d.batches) == 0 {
		return true
	}
	for {
		var open, callbacks int
		err := d.pool.QueryRow(context.Background(), `SELECT
			(SELECT count(*) FROM keel_batches WHERE completed_at IS NULL),
			(SELECT count(*) FROM keel_jobs WHERE kind = $1 AND status NOT IN ('succeeded', 'dead'))`,
			batchDoneKind.Name()).Scan(&open, &callbacks)
		if err == nil && open == 0 && callbacks == 0 {
			return true
		}
		if time.Now().After(deadline) {
			d.note(fmt.Sprintf("deadline: %d batches open, %d callbacks not ended (err %v)", open, callbacks, err))
			return false
		}
		time.Sleep(time.Second)
	}
}

// checkBatches checks every batch: complete once (generation 1), its
// counters equal to its members' statuses in the ledger, one on_complete
// run with those counts, and one on_success run exactly when every member
// succeeded.
func (d *driver) checkBatches(ctx context.Context) []string {
	if len(d.batches) == 0 {
		return nil
	}
	var failures []string
	fail := func(format string, args ...any) {
		failures = append(failures, fmt.Sprintf("batches: "+format, args...))
	}
	store := jobstore.NewStore(d.client.Pool())
	var members, successes int
	for _, id := range d.batches {
		b, err := store.GetBatch(ctx, id)
		if err != nil {
			fail("%s: %v", id, err)
			continue
		}
		statuses, err := store.BatchStatuses(ctx, id)
		if err != nil {
			fail("%s: %v", id, err)
			continue
		}
		want := tasks.BatchCounts{Total: b.Total, Succeeded: statuses[idempotency.StatusSucceeded],
			Dead: statuses[idempotency.StatusDead], Discarded: statuses[idempotency.StatusDiscarded],
			Cancelled: statuses[idempotency.StatusCancelled]}
		n := 0
		for _, c := range statuses {
			n += c
		}
		members += n
		got := tasks.BatchCounts{Total: b.Total, Succeeded: b.Succeeded, Dead: b.Dead, Discarded: b.Discarded, Cancelled: b.Cancelled}
		switch {
		case n != b.Total:
			fail("%s: total %d, but %d members in the ledger", id, b.Total, n)
		case got != want:
			fail("%s: counters %+v, the ledger says %+v", id, got, want)
		case b.State() != "complete" || b.Generation != 1:
			fail("%s: %s, generation %d; want complete, generation 1", id, b.State(), b.Generation)
		}
		runs := map[string][]tasks.BatchCounts{}
		rows, err := d.pool.Query(ctx, `SELECT event, generation, counts FROM chaos_batch_callbacks WHERE batch_id = $1`, id)
		if err != nil {
			fail("%s: %v", id, err)
			continue
		}
		for rows.Next() {
			var event string
			var gen int
			var raw []byte
			var c tasks.BatchCounts
			if err = rows.Scan(&event, &gen, &raw); err == nil {
				err = json.Unmarshal(raw, &c)
			}
			if err != nil {
				break
			}
			if gen != 1 {
				fail("%s: a %s callback of generation %d", id, event, gen)
			}
			runs[event] = append(runs[event], c)
		}
		rows.Close()
		if err != nil {
			fail("%s: %v", id, err)
			continue
		}
		if len(runs[tasks.BatchComplete]) != 1 || runs[tasks.BatchComplete][0] != want {
			fail("%s: on_complete ran with %+v; want once with %+v", id, runs[tasks.BatchComplete], want)
		}
		wantSuccess := 0
		if want.Succeeded == want.Total {
			wantSuccess = 1
			successes++
		}
		if len(runs[tasks.BatchSuccess]) != wantSuccess {
			fail("%s: on_success ran %d times; want %d (%+v)", id, len(runs[tasks.BatchSuccess]), wantSuccess, want)
		}
	}
	var cbJobs, cbDone int
	if err := d.pool.QueryRow(ctx, `SELECT count(*), count(*) FILTER (WHERE status = 'succeeded') FROM keel_jobs WHERE kind = $1`,
		batchDoneKind.Name()).Scan(&cbJobs, &cbDone); err != nil {
		fail("%v", err)
	}
	if cbJobs != len(d.batches)+successes || cbDone != cbJobs {
		fail("%d callback jobs, %d succeeded; want %d, all succeeded", cbJobs, cbDone, len(d.batches)+successes)
	}
	if d.cfg.Batches > 0 && (successes == 0 || successes == d.cfg.Batches) {
		fail("%d of %d batches all succeeded: the run did not exercise both callbacks", successes, d.cfg.Batches)
	}
	if d.deadlineBatch != "" {
		if b, err := store.GetBatch(ctx, d.deadlineBatch); err != nil || b.Total == 0 {
			fail("the deadline jobs' batch %s has no members (%v)", d.deadlineBatch, err)
		}
	}
	d.note(fmt.Sprintf("batches: %d batches of %d members in all, %d all succeeded; %d callback jobs", len(d.batches), members, successes, cbJobs))
	return failures
}
