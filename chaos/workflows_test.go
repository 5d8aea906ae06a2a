package chaos_test

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/keeljobs/keel/idempotency"
	"github.com/keeljobs/keel/tasks"
)

// flowKind is the workflows variant's step. Its name is outside "chaos:"
// so the soak's own accounting of jobs leaves it alone.
var flowKind = tasks.Define[order]("chaosflow:step", tasks.Key(orderKey), tasks.MaxRetry(20))

// flowTasks is each workflow's shape: a fan-out, a fan-in and a tail.
var flowTasks = []struct {
	name  string
	after []string
}{{"a", nil}, {"b", []string{"a"}}, {"c", []string{"a"}}, {"d", []string{"b", "c"}}, {"e", []string{"d"}}}

// runFlowStep records, when it starts, any parent of its job that has not
// succeeded (a run released too early), then commits its effect in its
// completing InTx: a job run twice to completion would add a second row.
func runFlowStep(pool *pgxpool.Pool) func(context.Context, order) error {
	return func(ctx context.Context, o order) error {
		id, _ := idempotency.JobID(ctx)
		if _, err := pool.Exec(ctx, `INSERT INTO chaos_flow_early (job_id, parent)
			SELECT $1, d.parent_id FROM keel_job_deps d JOIN keel_jobs p ON p.id = d.parent_id
			WHERE d.child_id = $1 AND p.status <> 'succeeded'`, id); err != nil {
			return err
		}
		if err := pause(ctx, latency()); err != nil {
			return err
		}
		return idempotency.InTx(ctx, func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `INSERT INTO chaos_flow_effects (job_id) VALUES ($1)`, id)
			return err
		})
	}
}

// submitWorkflows enqueues cfg.Workflows workflows spread over the
// submission window, each until it is accepted (a retry after a fault
// dedupes the tasks already in).
func (d *driver) submitWorkflows(ctx context.Context) <-chan struct{} {
	done := make(chan struct{})
	go func() {
		defer close(done)
		if d.cfg.Workflows == 0 {
			return
		}
		interval := d.cfg.SubmitOver / time.Duration(d.cfg.Workflows)
		for i := range d.cfg.Workflows {
			wf := tasks.NewWorkflow(fmt.Sprintf("chaosflow-%03d", i))
			for _, t := range flowTasks {
				wf.Add(t.name, flowKind.New(order{Key: fmt.Sprintf("flow-%03d-%s", i, t.name)}), t.after...)
			}
			for {
				_, err := d.client.EnqueueWorkflow(ctx, wf)
				if err == nil {
					break
				}
				d.note(fmt.Sprintf("workflow %d: %v (retrying)", i, err))
				if pause(ctx, time.Second) != nil {
					return
				}
			}
			if pause(ctx, interval) != nil {
				return
			}
		}
	}()
	return done
}

// workflowsConverge waits until every workflow job has ended.
func (d *driver) workflowsConverge(deadline time.Time) bool {
	if d.cfg.Workflows == 0 {
		return true
	}
	for {
		var open int
		err := d.pool.QueryRow(context.Background(), `SELECT count(*) FROM keel_jobs
			WHERE kind = $1 AND status NOT IN ('succeeded', 'dead', 'discarded', 'cancelled')`, flowKind.Name()).Scan(&open)
		if err == nil && open == 0 {
			return true
		}
		if time.Now().After(deadline) {
			d.note(fmt.Sprintf("deadline: %d workflow jobs not ended (err %v)", open, err))
			return false
		}
		time.Sleep(time.Second)
	}
}

// checkWorkflows: every workflow whole, every job succeeded once (one
// effect), none run before its parents succeeded, none left waiting.
func (d *driver) checkWorkflows(ctx context.Context) []string {
	if d.cfg.Workflows == 0 {
		return nil
	}
	var failures []string
	var jobs, succeeded, waiting, early, doubled, missing, wrongEdges int
	err := d.pool.QueryRow(ctx, `SELECT count(*), count(*) FILTER (WHERE status = 'succeeded'),
			count(*) FILTER (WHERE status = 'waiting' OR waiting_on <> 0),
			(SELECT count(DISTINCT job_id) FROM chaos_flow_early),
			(SELECT count(*) FROM (SELECT job_id FROM chaos_flow_effects GROUP BY job_id HAVING count(*) > 1) x),
			count(*) FILTER (WHERE status = 'succeeded' AND NOT EXISTS (SELECT 1 FROM chaos_flow_effects e WHERE e.job_id = j.id)),
			(SELECT count(*) FROM keel_job_deps dd JOIN keel_jobs c ON c.id = dd.child_id WHERE c.kind = $1)
		FROM keel_jobs j WHERE kind = $1`, flowKind.Name()).Scan(&jobs, &succeeded, &waiting, &early, &doubled, &missing, &wrongEdges)
	if err != nil {
		return []string{fmt.Sprintf("workflows: %v", err)}
	}
	edges := 0
	for _, t := range flowTasks {
		edges += len(t.after)
	}
	want := d.cfg.Workflows * len(flowTasks)
	for _, c := range []struct {
		ok   bool
		what string
	}{
		{jobs == want, fmt.Sprintf("%d workflow jobs, want %d (lost or doubled)", jobs, want)},
		{succeeded == want, fmt.Sprintf("%d of %d workflow jobs succeeded (the rest stuck or dead)", succeeded, want)},
		{waiting == 0, fmt.Sprintf("%d workflow jobs still waiting", waiting)},
		{early == 0, fmt.Sprintf("%d workflow jobs ran before a parent had succeeded", early)},
		{doubled == 0, fmt.Sprintf("%d workflow jobs committed their effect twice", doubled)},
		{missing == 0, fmt.Sprintf("%d succeeded workflow jobs without their effect", missing)},
		{wrongEdges == d.cfg.Workflows*edges, fmt.Sprintf("%d dependencies, want %d", wrongEdges, d.cfg.Workflows*edges)},
	} {
		if !c.ok {
			failures = append(failures, "workflows: "+c.what)
		}
	}
	d.note(fmt.Sprintf("workflows: %d jobs in %d workflows, %d succeeded, %d early, %d doubled, %d waiting",
		jobs, d.cfg.Workflows, succeeded, early, doubled, waiting))
	return failures
}
